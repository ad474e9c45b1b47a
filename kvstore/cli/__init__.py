"""The `kvstore` command line (entry point `kvstore.cli.main:main`).

Nothing is imported here on purpose: `python -m kvstore.cli.main` would otherwise find the module already
imported by its package and warn.
"""
