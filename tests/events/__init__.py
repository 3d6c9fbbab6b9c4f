"""Tests of events/: the timeline, logging into it, partitions and archive, artifact storage."""
