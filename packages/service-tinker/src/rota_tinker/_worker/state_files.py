"""Training checkpoints on disk (``save_state`` / ``load_state``): the files a user can also load without rota.

Written and read by a tenant's trainer (:mod:`rota_tinker._worker.main`), inside a turn (the model is
on its device). One folder per checkpoint, ``DATA_DIR/TENANT/MODEL/weights/NAME/``. Weights saved
for the sampler (``save_weights_for_sampler``) are the same files without ``optimizer.pt``, in
``DATA_DIR/TENANT/MODEL/sampler_weights/NAME/``, written by the trainer from the tracked host copy
(no turn) and read by the tenant's sampler:

* a LoRA model: ``adapter_config.json`` + ``adapter_model.safetensors``, written by peft's
  ``save_pretrained`` (``peft.PeftModel.from_pretrained(base, folder)`` loads them);
* a full-parameter Hugging Face model: ``config.json`` + ``*.safetensors`` from transformers'
  ``save_pretrained``, plus the base's tokenizer files (``AutoModelForCausalLM.from_pretrained``
  loads it); the test transformer: ``model.safetensors`` of its state dict;
* ``optimizer.pt``: the AdamW state (moments and step counts), so a resumed run continues
  bit-identically; ``rota.json``: the base model's name and the LoRA settings.

Folders are 0700 (:func:`private_dir`, also used by the service for the data directory and
each tenant's) and files 0600; a checkpoint is written to a temporary folder and renamed
into place, so a reader never sees half of one.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import stat
from typing import Any

from rota.errors import ConfigError

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json")


def private_dir(path: str) -> str:
    """Make ``path`` a directory of this uid with mode 0700 (created so, or tightened); refuse a link or another's."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{path!r} is a symbolic link or not a directory; give a directory of this user")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"{path!r} belongs to uid {st.st_uid}, not to this service's uid {os.geteuid()}; give a "
                          "directory of this user")
    if stat.S_IMODE(st.st_mode) != 0o700:
        log.warning("%s had mode %o; made it 0700 (only this service reads what it holds)", path,
                    stat.S_IMODE(st.st_mode))
        os.chmod(path, 0o700)
    return path


def write(folder: str, entry: Any, base: Any, *, weights: dict[str, Any] | None = None, optimizer: bool = True) -> int:
    """Write ``entry`` (the trainer's model) as checkpoint ``folder`` (replaced if it exists); its size in bytes.

    ``weights``: the state dict of what is trained (``entry.trainable``) to write instead of the model's
    own tensors: its tracked host copy, readable while the model is parked. ``optimizer=False``: no
    ``optimizer.pt`` (sampler weights).
    """
    import torch

    from rota_tinker._worker.models import peft_state

    def fill(tmp: str) -> None:
        if entry.lora is not None:
            entry.model.peft_config["default"].base_model_name_or_path = base.name
            given = {} if weights is None else {"state_dict": peft_state(entry.model, weights)}
            entry.model.save_pretrained(tmp, **given)
        elif hasattr(entry.model, "save_pretrained"):
            entry.model.save_pretrained(tmp, **({} if weights is None else {"state_dict": weights}))
            for name in TOKENIZER_FILES:
                src = os.path.join(base.path, name)
                if os.path.isfile(src):
                    shutil.copyfile(src, os.path.join(tmp, name))
        else:
            from safetensors.torch import save_file

            save_file({k: v.detach().contiguous() for k, v in (weights or entry.model.state_dict()).items()},
                      os.path.join(tmp, "model.safetensors"))
        if optimizer:
            torch.save(entry.optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))

    return _write_folder(folder, fill, base, entry.lora)


def write_adapters(folder: str, adapters: dict[str, Any], config: Any, base: Any, lora: dict[str, Any],
                   optimizer_state: dict[str, Any] | None) -> int:
    """Write a LoRA checkpoint from peft-named ``adapters`` and peft's ``config`` (the batched engine's models,
    :mod:`rota_tinker._worker.batch`): the files :func:`write` gives a trainer's LoRA model, which
    :func:`read_weights` and ``peft.PeftModel.from_pretrained`` load; ``optimizer_state``: None for sampler
    weights."""
    import torch
    from safetensors.torch import save_file

    def fill(tmp: str) -> None:
        config.base_model_name_or_path = base.name
        config.save_pretrained(tmp)
        save_file({k: v.contiguous() for k, v in adapters.items()}, os.path.join(tmp, "adapter_model.safetensors"))
        if optimizer_state is not None:
            torch.save(optimizer_state, os.path.join(tmp, "optimizer.pt"))

    return _write_folder(folder, fill, base, lora)


def _write_folder(folder: str, fill: Any, base: Any, lora: dict[str, Any] | None) -> int:
    """Let ``fill(tmp)`` write a checkpoint's files into a fresh 0700 folder, add ``rota.json``, make every file 0600,
    then put it in place of ``folder`` (a reader never sees half of one); its size in bytes."""
    tmp = f"{folder}.{secrets.token_hex(4)}.tmp"
    os.mkdir(tmp, 0o700)
    try:
        fill(tmp)
        with open(os.path.join(tmp, "rota.json"), "w") as f:
            json.dump({"base_model": base.name, "lora": lora}, f)
        size = 0
        for name in os.listdir(tmp):
            path = os.path.join(tmp, name)
            os.chmod(path, 0o600)
            size += os.path.getsize(path)
        if os.path.isdir(folder):
            shutil.rmtree(folder)
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return size


def saved_lora(folder: str) -> dict[str, Any] | None:
    """The LoRA settings (rank, seed, targets) checkpoint ``folder`` was saved with; None for full weights."""
    with open(os.path.join(folder, "rota.json")) as f:
        return json.load(f)["lora"]


def read_weights(folder: str, model: Any, lora: dict[str, Any] | None) -> None:
    """Load the weights of checkpoint ``folder`` into ``model`` in place: adapters into a peft model (``lora``
    given), else every weight."""
    from safetensors.torch import load_file

    if lora is not None:
        import peft

        adapters = load_file(os.path.join(folder, "adapter_model.safetensors"))
        result = peft.set_peft_model_state_dict(model, adapters)
        if result.unexpected_keys:
            raise ValueError(f"checkpoint {os.path.basename(folder)} holds adapters this model lacks: "
                             f"{result.unexpected_keys[:4]}")
        return
    state: dict[str, Any] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(folder, name)))
    result = model.load_state_dict(state, strict=False)
    tied = {k for k, t in model.state_dict().items() if k not in state and any(
        t.data_ptr() == s.data_ptr() for s in model.state_dict().values() if s is not t)}
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(f"checkpoint {os.path.basename(folder)} does not fit this model: missing {missing[:4]}, "
                         f"unexpected {result.unexpected_keys[:4]}")


def read(folder: str, entry: Any, optimizer: bool) -> None:
    """Load checkpoint ``folder`` into ``entry`` in place (its tensors stay tracked); the optimizer state too,
    or a fresh one (``optimizer=False``)."""
    import torch

    read_weights(folder, entry.model, entry.lora)
    if optimizer:
        saved = torch.load(os.path.join(folder, "optimizer.pt"), map_location="cpu", weights_only=True)
        # fresh tensors: the loaded ones' storages cannot be resized, which parking them needs
        saved["state"] = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
                          for i, st in saved["state"].items()}
        entry.optimizer.load_state_dict(saved)
    else:
        entry.optimizer.state.clear()
