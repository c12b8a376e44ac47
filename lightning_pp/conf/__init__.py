"""Hydra configs of `python -m lightning_pp.train` (a package so that Hydra finds them when installed)."""
