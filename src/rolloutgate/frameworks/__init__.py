"""Plugins that put rolloutgate where an RL framework expects its own router (docs/frameworks/).

Each module here is imported by the framework, by name, from its own configuration; none imports the framework
at rolloutgate's import time."""
