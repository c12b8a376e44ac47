"""Example modules and data that need no download: what the Hydra app and the README train."""
