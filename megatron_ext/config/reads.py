"""What a recipe may set: the fields its trainer reads, and nothing else.

Every trainer reads the run sections (``trainer``, ``run_dir``, ``logging``, ``checkpoint``,
``launch``) and its own section (``soma:``, ``dipaco:``). The shared sections (``model``,
``optimizer``, ``data``, ``training``, ``parallel``) are read only as far as the trainer
declares (:attr:`~megatron_ext.config.trainers.TrainerSpec.reads`): SOMA reads ``data.source`` and
the stop fields of ``training``, nothing of ``optimizer`` or ``model``. A recipe that
sets a field its trainer does not read is refused before any process starts — otherwise
``megatron-ext launch soma_tiny optimizer.name=muon`` would run the SPSA trainer it always ran,
while the user believes it switched to Muon.

Checked on the raw mapping (the recipe file with its overrides and an MoE preset expanded), so
a field counts as set when the user wrote it, whatever its value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_ext.config.trainers import TrainerSpec, trainers
from megatron_ext.errors import ConfigError

__all__ = ["RUN_SECTIONS", "check_reads", "describe_reads"]

#: read by every trainer (the fields of :class:`megatron_ext.config.schema.Recipe`)
RUN_SECTIONS = ("trainer", "run_dir", "seed", "logging", "checkpoint", "launch")


def describe_reads(spec: TrainerSpec) -> str:
    """What ``spec`` reads, as a recipe writes it: ``soma, data.source,
    training.{exit_interval, ...}, and run_dir, seed, logging, checkpoint, launch``."""
    parts = list(spec.sections)
    for name, fields in spec.reads.items():
        if fields is None:
            parts.append(name)
        elif len(fields) == 1:
            parts.append(f"{name}.{fields[0]}")
        else:
            parts.append(f"{name}.{{{', '.join(fields)}}}")
    return f"{', '.join(parts)}, and {', '.join(RUN_SECTIONS[1:])}"


def check_reads(raw: Mapping[str, Any], spec: TrainerSpec) -> None:
    """Refuse (``ConfigError``, one line) the first key of ``raw`` that trainer ``spec`` does
    not read: a field of another trainer's section outside its ``reads``, or a section of
    another trainer it does not read at all."""
    unread = _unread(raw, spec)
    if not unread:
        return
    more = f" (and {len(unread) - 1} more: {', '.join(unread[1:4])})" if len(unread) > 1 else ""
    owners = [s.name for s in trainers().values() if _reads_key(s, unread[0])]
    switch = f", or choose trainer={' or trainer='.join(owners)}" if owners else ""
    raise ConfigError(
        f"trainer={spec.name} does not read {unread[0]}{more}; it reads "
        f"{describe_reads(spec)}: remove the key{switch}"
    )


def _unread(raw: Mapping[str, Any], spec: TrainerSpec) -> list[str]:
    found = []
    for name, value in raw.items():
        if name in RUN_SECTIONS or name in spec.sections:
            continue
        if name not in spec.reads:
            found.append(str(name))
            continue
        fields = spec.reads[name]
        if fields is not None and isinstance(value, Mapping):
            found.extend(f"{name}.{key}" for key in value if key not in fields)
    return found


def _reads_key(spec: TrainerSpec, key: str) -> bool:
    """Whether trainer ``spec`` reads ``key`` (``section`` or ``section.field``)."""
    section, _, name = key.partition(".")
    if section in spec.sections:
        return True
    if section not in spec.reads:
        return False
    fields = spec.reads[section]
    return fields is None or not name or name in fields
