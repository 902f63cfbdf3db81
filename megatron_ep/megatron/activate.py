"""`import megatron_ep.megatron.activate` installs megatron_ep's flex managers into megatron-core.

For places that can only import a module (a Megatron-LM `--spec` module, a plugin list)."""

from . import install

features = install()
