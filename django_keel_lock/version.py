"""The package's version, in a module of its own: setup.cfg reads it without importing Django,
and the OpenTelemetry backend names its tracer and meter with it without importing the package
root (which imports the core, which imports the metrics backends)."""

__version__ = "0.1.0"
