"""
Writing checkpoints so that nothing is lost (checkpoint.py reads them).

save writes a whole checkpoint directory atomically: into .NAME.saving first, then renamed into
place (the previous one moved to .NAME.replaced, then deleted), so that a process killed at any
moment leaves a whole checkpoint on disk, which checkpoint.load finds (located) and the next save or
run puts in place (recover). Only directories a save made (they hold MARK) are ever moved or
deleted. Before a run writes its first checkpoint, check_out refuses what a save could not
replace, and hold locks the directory for the run's life.
"""

import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

# the embedded models, which training never writes
EMBEDDED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints")
MARK = ".nosa-save"  # in every directory a save makes: what recovery may move or delete


def staging(path):
    """Where a save of path writes first, and where it moves the checkpoint it replaces: hidden
    names beside path that the project owns (.NAME.saving, .NAME.replaced)."""
    parent, name = os.path.split(os.path.normpath(path))
    return os.path.join(parent, f".{name}.saving"), os.path.join(parent, f".{name}.replaced")


def made_by_save(d):
    return os.path.isdir(d) and not os.path.islink(d) and os.path.isfile(os.path.join(d, MARK))


def save(model, tokenizer, path, dtype=None, train_state=None, optimizer=None):
    """Write weights (in `dtype`, or as they are), config, tokenizer and, for a training run, its state
    (train_state.json) and the optimizer's (optimizer.pt). Atomic: everything goes to .NAME.saving
    first, which then replaces path by renames (the previous checkpoint moved to .NAME.replaced,
    then deleted), so a process killed at any moment leaves a whole checkpoint on disk, which checkpoint.load
    finds and the next save or run puts in place (`recover`). Only directories a save made (they
    hold MARK) are ever moved or deleted; path is resolved by the caller (a link is refused)."""
    path = os.path.normpath(path)
    if os.path.islink(path):
        raise ValueError(f"{path} is a symbolic link; give the directory it points to")
    tmp, old = staging(path)
    recover(path)  # a killed save's directories, or one line naming what is in the way
    try:
        write(model, tokenizer, tmp, dtype, train_state, optimizer)
    except Exception as e:  # a full disk, a quota: the serializers say so in many lines
        shutil.rmtree(tmp, ignore_errors=True)
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise OSError(
            f"could not save a checkpoint to {path} ({reason}); the previous one there, "
            f"if any, is intact: free disk space and --resume"
        ) from None
    replaces = os.path.isdir(path)
    if replaces:
        foreign = foreign_files(path)
        if foreign:  # check_out refused it before the run; never delete what is not ours
            shutil.rmtree(tmp, ignore_errors=True)
            raise FileExistsError(
                f"{path} holds {foreign[0]}, which is not a checkpoint of ours: not replaced"
            )
        open(os.path.join(path, MARK), "w").close()  # (one an older version saved lacks it)
        os.rename(path, old)
    os.rename(tmp, path)
    if replaces:
        shutil.rmtree(old)


def write(model, tokenizer, tmp, dtype, train_state, optimizer):
    """save's files, into the directory tmp (the mark first: a killed save's is recognised)."""
    os.makedirs(tmp)
    with open(os.path.join(tmp, MARK), "w") as f:
        f.write("a directory of saving.save; its next save or run removes it when it is left\n")
    sd = {k: v.detach().to(dtype or v.dtype).contiguous() for k, v in model.state_dict().items()}
    # fused weights are views
    sd = {k: v.clone() if v.device.type == "cpu" else v.cpu() for k, v in sd.items()}
    if model.cfg.tie_embeddings:
        sd.pop("lm_head.weight")
    save_file(sd, os.path.join(tmp, "model.safetensors"))
    umask = os.umask(0)
    os.umask(umask)
    # as readable as the files beside it
    os.chmod(os.path.join(tmp, "model.safetensors"), 0o666 & ~umask)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(model.cfg.to_dict(), f, indent=1)
    tokenizer.save(os.path.join(tmp, "tokenizer.json"))
    # how the model generates, as checkpoint.side_files reads it back: its end-of-sequence ids, the special
    # tokens its chat template refers to, the template
    for name, obj in (
        (
            "generation_config.json",
            {"eos_token_id": sorted(model.eos_ids)} if model.eos_ids else None,
        ),
        ("tokenizer_config.json", model.special_tokens or None),
    ):
        if obj:
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(obj, f, indent=1)
    if model.chat_template:
        with open(os.path.join(tmp, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(model.chat_template)
    if train_state is not None:
        with open(os.path.join(tmp, "train_state.json"), "w") as f:
            json.dump(train_state, f)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))


# what save writes
FILES = (
    MARK,
    "model.safetensors",
    "config.json",
    "tokenizer.json",
    "generation_config.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "train_state.json",
    "optimizer.pt",
)


def foreign_files(path):
    """What a directory holds besides the files of a checkpoint of ours (a save replaces it whole)
    and the locks of runs into what it holds (hold: .NAME.lock beside NAME, holding a process id)."""

    def lock(f):
        if not (
            f.startswith(".")
            and f.endswith(".lock")
            and os.path.lexists(os.path.join(path, f[1:-5]))
        ):
            return False
        with open(os.path.join(path, f), errors="replace") as fh:
            return fh.read(32).strip().isdigit()

    return sorted(f for f in os.listdir(path) if f not in FILES and not lock(f))


def check_out(path):
    """Before a run writes its first checkpoint to path: refuse, in one line, a path inside the
    repository's checkpoints/ (the embedded models), a file, a directory that holds anything but a
    checkpoint of ours (save replaces the directory whole), and a place that cannot be written
    (a probe file beside it, where save writes first)."""
    path = os.path.abspath(path)
    embedded = os.path.realpath(EMBEDDED)
    if os.path.commonpath([os.path.realpath(path), embedded]) == embedded:  # links resolved
        raise ValueError(
            f"--out {path}: training never writes into {embedded} (the embedded models); write "
            f"elsewhere and copy a model there yourself"
        )
    recover(path)
    if os.path.isfile(path):
        raise FileExistsError(f"--out {path} is a file; give a directory")
    if os.path.ismount(path):  # a save renames a new directory into place: not over a mount point
        raise ValueError(
            f"--out {path} is a mount point, which a save cannot replace; give a "
            f"directory inside it"
        )
    if os.path.isdir(path):
        foreign = foreign_files(path)
        if foreign:
            raise FileExistsError(
                f"--out {path} holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}, "
                f"which is not a checkpoint of ours, and a save replaces the directory whole: "
                f"give a new or empty directory"
            )
    parent = os.path.dirname(path)
    try:
        os.makedirs(parent, exist_ok=True)
        probe = os.path.join(parent, f".{os.path.basename(path)}.{os.getpid()}.probe")
        with open(probe, "w") as f:
            f.write("probe")
        os.remove(probe)
    except OSError as e:
        raise PermissionError(
            f"--out {path}: cannot write in {parent} ({e.strerror}); give a writable directory"
        ) from None


def hold(path):
    """A lock on the output directory path for the life of this process (released at its exit, a
    crash included): a second run into it is refused in one line that names the first one's
    process. Returns the lock file, to keep open."""
    import fcntl

    path = os.path.abspath(path)
    lock = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.lock")
    f = open(lock, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        pid = f.read().strip() or "?"
        f.close()
        raise ValueError(
            f"--out {path}: another run (process {pid}) is writing there; wait for "
            f"it to end, or give another --out"
        ) from None
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f


def recover(path):
    """Before a save or a run writes path: where a save was killed, the newest whole checkpoint put
    at path, said in one line (killed between its renames: the previous one moved back; after
    them: the previous one deleted; while writing: the unfinished one deleted). A directory in the
    staging places that a save did not make is left alone, and refused in one line."""
    path = os.path.normpath(path)
    tmp, old = staging(path)
    for d in (tmp, old):
        if os.path.lexists(d) and not made_by_save(d):
            raise FileExistsError(
                f"{d} is in the way of saving {path} and was not made by a save of this "
                f"project; move it elsewhere"
            )
    if os.path.isdir(tmp):
        shutil.rmtree(tmp)
        print(f"recovered {path}: removed {tmp}, a save that was killed", file=sys.stderr)
    if not os.path.isdir(old):
        return
    if os.path.isdir(path):
        shutil.rmtree(old)
        print(f"recovered {path}: removed {old}, which a killed save left behind", file=sys.stderr)
    else:
        os.rename(old, path)
        print(f"recovered {path}: the checkpoint a killed save had moved aside", file=sys.stderr)


def located(path):
    """Where the checkpoint of path is to be read: path, or, where a save was killed between its
    renames, the previous checkpoint it had moved aside (read where it is: loading never moves or
    deletes anything)."""
    old = staging(path)[1]
    if not os.path.exists(path) and made_by_save(old):
        return old
    return path
