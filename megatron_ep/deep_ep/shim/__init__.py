"""The folder python -m megatron_ep.deep_ep --path names: its deep_ep package serves `import deep_ep`."""
