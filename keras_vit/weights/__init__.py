"""Checkpoint loading. The readers and presets are filled in by the weights work."""


def resolve(weights):
    """Return a local file for a preset name; raise a ValueError otherwise."""
    raise ValueError(
        "`weights` must be None, an existing checkpoint file or a known preset name. "
        f"Received: weights={weights!r} (no such file, and no preset of that name)"
    )
