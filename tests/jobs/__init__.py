"""Tests of jobs/: the engine's state, enqueue, claim, reports, builder and its duties, triggers, redrive, retention."""
