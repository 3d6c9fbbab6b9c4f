"""Tests of workflows/: services, workflows, validation, governor conditions."""
