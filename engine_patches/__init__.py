"""Patches that run Rollplex's hooks inside other rollout engines' processes.

Each subpackage targets one engine, is importable without that engine installed (classes that
subclass the engine's own are built by factories from the base class), and keeps the list of the
engine's names it relies on in one table that the contract tests check against the engine's source.
"""
