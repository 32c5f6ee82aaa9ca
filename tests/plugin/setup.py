"""A throwaway third-party distribution that extends megatron-ext only through entry points
(tests/test_registry.py installs it into a temporary folder)."""

from setuptools import setup

setup(
    name="mx-plugin",
    version="0.0.1",
    packages=["mx_plugin"],
    entry_points={
        "megatron_ext.optimizers": ["sign_descent = mx_plugin.spec:SPEC"],
        "megatron_ext.trainers": ["countdown = mx_plugin.countdown:TRAINER"],
    },
)
