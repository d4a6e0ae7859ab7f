"""Argument checks shared by the large-minibatch schedule and callback (internal)."""

import numbers

WARMUP_KINDS = ("gradual", "constant")


def positive_number(owner, name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{owner}: {name} must be a positive number, got {value!r}")
    return float(value)


def positive_int(owner, name, value, *, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{owner}: {name} must be a positive integer, got {value!r}")
    return int(value)


def non_negative_number(owner, name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0:
        raise ValueError(f"{owner}: {name} must be a number >= 0, got {value!r}")
    return float(value)


def warmup_kind(owner, value):
    if value not in WARMUP_KINDS:
        raise ValueError(f"{owner}: warmup must be one of {WARMUP_KINDS}, got {value!r}")
    return value


def warmup_fits(owner, warmup_epochs, total_epochs):
    if total_epochs is not None and warmup_epochs > total_epochs:
        raise ValueError(
            f"{owner}: warmup_epochs={warmup_epochs:g} is longer than training "
            f"({total_epochs:g} epochs); shorten the warm-up or train longer"
        )
