"""optstate.ReadNote: the notes `optstate inspect` prints, given to Python callers as warnings."""
import os
import sys
import warnings

# Frames a warning skips to reach the caller's line: this package's and torch.no_grad()'s wrapper
# (a private module of torch: where a release has none, its frame is the one the warning names).
_SKIPPED = (os.path.dirname(os.path.abspath(__file__)) + os.sep,)
try:
    import torch.utils._contextlib as _torch_contextlib
    _SKIPPED += (os.path.abspath(_torch_contextlib.__file__),)
except ImportError:
    pass


class ReadNote(UserWarning):
    """What a read of a checkpoint says beside its values, as ``optstate inspect`` and ``convert``
    print it: where the path led (a training run's save folder, read at the save its tracker names)
    and values read as the file does not say them (DeepSpeed's FusedAdam steps, Megatron's groups).
    ``optstate.read_state_dict`` and ``optstate.load`` warn with one per note once the read has
    succeeded; ``warnings.filterwarnings("ignore", category=optstate.ReadNote)`` silences them."""


def _caller_stacklevel():
    """warnings.warn's stacklevel, called from here, of the first frame outside optstate and its
    decorators (Python 3.12's skip_file_prefixes, by hand)."""
    level, frame = 2, sys._getframe(2)  # 1 warn_read_notes, 2 its caller
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_SKIPPED):
        level, frame = level + 1, frame.f_back
    return level


def warn_read_notes(ck, path):
    """Warns once per note of ``ck`` (torch.classes.optstate.Checkpoint), where the path led first,
    at the line that called into optstate."""
    notes = ck.read_notes()
    if not notes:
        return
    level = _caller_stacklevel()
    for note in notes:
        warnings.warn(f"optstate: {path}: {note}", ReadNote, stacklevel=level)
