"""Flags from a config dataclass (``paratrain.flags``): names, types, defaults and help from the fields, a nested
config's fields in a group, values checked by the config itself, and a config written back as flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from paratrain.errors import ConfigError
from paratrain.flags import NO_FLAG, add_flags, at_least, build, flag, to_argv


@dataclass(frozen=True, kw_only=True)
class Inner:
    """A nested config."""

    depth: int = 3
    """How deep."""


@dataclass(frozen=True, kw_only=True)
class Job:
    """A config as a command's."""

    world: int = field(metadata=flag("--world", "-w"))
    """Processes, 100% of them."""
    batch_size: int = 64
    """Samples per step."""
    lr: float | None = None
    """Learning rate."""
    resume: bool = False
    """Start from the latest checkpoint."""
    shuffle: bool = True
    """Reshuffle every epoch."""
    tied: bool | None = field(default=None, metadata=flag("--tied", negative="--untied"))
    """Tie the head."""
    inner: Inner = field(default_factory=lambda: Inner(depth=5), metadata=flag(title="inner part"))
    """Nested."""
    secret: str = field(default="x", metadata=NO_FLAG)
    """Set from Python only."""

    def __post_init__(self) -> None:
        at_least(self, {"world": 1, "batch_size": 1})


def parse(argv: list[str]) -> Job:
    parser = argparse.ArgumentParser()
    add_flags(parser, Job)
    return build(Job, parser.parse_args(argv))


def test_each_field_is_a_flag_of_its_type_default_and_docstring():
    parser = argparse.ArgumentParser()
    add_flags(parser, Job)
    text = parser.format_help()
    flat = " ".join(text.split())
    assert "--batch-size BATCH_SIZE Samples per step (default: 64)" in flat
    assert "--world WORLD, -w WORLD Processes, 100% of them." in flat  # a % in a docstring is not a format
    assert "inner part:" in text and "--depth" in text and "--secret" not in text
    assert "--shuffle, --no-shuffle" in text and "--untied" in text
    assert parse(["-w", "2"]) == Job(world=2, inner=Inner(depth=5))  # the nested default is the field's own
    config = parse(
        ["--world", "4", "--batch-size", "8", "--lr", "0.5", "--resume", "--no-shuffle", "--untied", "--depth", "7"]
    )
    assert config == Job(world=4, batch_size=8, lr=0.5, resume=True, shuffle=False, tied=False, inner=Inner(depth=7))


def test_a_value_the_config_refuses_is_its_one_line_error_naming_the_flag():
    with pytest.raises(ConfigError, match=r"^--world must be >= 1, got 0$"):
        parse(["--world", "0"])
    with pytest.raises(ConfigError, match=r"^--batch-size must be >= 1, got -2$"):
        parse(["--world", "1", "--batch-size", "-2"])
    with pytest.raises(SystemExit):  # a required field is a required flag
        parse([])


def test_a_config_written_back_as_flags_reads_back_the_same():
    config = Job(world=3, lr=0.1, resume=True, shuffle=False, tied=True)
    argv = to_argv(config, skip=("inner",))
    assert argv == ["--world", "3", "--lr", "0.1", "--resume", "--no-shuffle", "--tied"]  # defaults left out
    assert parse(argv) == config
    assert to_argv(config, only=("world", "lr")) == ["--world", "3", "--lr", "0.1"]
