"""The failure path: :mod:`jobs.failure.decide` decides (a pure function), :mod:`jobs.failure.apply` writes."""
