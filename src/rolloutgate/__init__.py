"""rolloutgate: an inference gateway for agentic RL rollouts whose timeouts measure engine work."""

__version__ = "0.1.0"
__all__ = ("__version__",)
