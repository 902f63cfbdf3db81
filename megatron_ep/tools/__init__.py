"""What is not the library: the demo, the resource estimate, tracing for benchmarks and
profilers, the analytic model, and what every command shares (cli). Standard-library imports
only at this level: a command run outside the project's environment says so in one line."""
