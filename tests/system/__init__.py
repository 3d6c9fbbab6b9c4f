"""System tests across the apps: chaos, a fleet through PgBouncer, an embedding site, the browser, deploy files
and scripts.
"""
