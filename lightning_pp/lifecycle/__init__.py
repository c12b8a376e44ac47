"""A rank's process from start to end: launching the other ranks, a failure that stops them all, a clean exit.

Imports: no other wing.
"""
