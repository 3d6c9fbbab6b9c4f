"""Tests of nodes/: the fleet, presence, wake, the agent and its executors, as real processes where the agent
decides.
"""
