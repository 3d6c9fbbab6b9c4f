"""Tests of accs_site/: the HTTP API and its schemas, the production server, the daemons' command lines,
upgrade checks.
"""
