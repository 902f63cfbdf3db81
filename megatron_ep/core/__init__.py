"""The API (Buffer, dispatch/combine, the types and errors) and what every backend shares: the
checks, the call protocol, the environment variables, expert-major placement, FP8 and LogFMT,
replays and the output hook. `import megatron_ep` exports the public names."""
