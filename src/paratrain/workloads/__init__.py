"""Built-in workloads: small real or synthetic training jobs used by the demo, benchmarks and tests."""
