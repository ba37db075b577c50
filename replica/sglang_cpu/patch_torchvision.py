"""Make PyPI's torchvision importable next to a CPU torch (run with the SGLang env's interpreter).

SGLang imports torchvision unconditionally. PyPI's ``torchvision`` wheel is a CUDA build whose
compiled ops do not load against ``torch+cpu``; ``torchvision/_meta_registrations.py`` then fails at
import in ``register_fake("torchvision::nms")`` (the operator does not exist). Nothing SGLang runs on
a text model uses those ops, so the two fake registrations (nms, qnms) are guarded on
``torchvision.extension._has_ops()``. The edit is idempotent and fails loudly when the file no
longer looks as expected (a new torchvision needs a new look).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

MARK = "# kvroute: guarded for a CPU torch without torchvision's compiled ops"


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        print("patch_torchvision: torchvision is not installed", file=sys.stderr)
        return 1
    path = Path(spec.origin).parent / "_meta_registrations.py"
    text = path.read_text(encoding="utf-8")
    if MARK in text:
        print(f"patch_torchvision: already patched: {path}")
        return 0
    pattern = re.compile(r'^@torch\.library\.register_fake\("torchvision::(nms|qnms)"\)$', re.MULTILINE)
    hits = pattern.findall(text)
    if not hits:
        print(f"patch_torchvision: no register_fake for nms/qnms in {path}; look again", file=sys.stderr)
        return 1
    text = pattern.sub(lambda m: f'@_kvroute_guarded_fake("torchvision::{m.group(1)}")', text)
    guard = (
        f"\n\n{MARK}\n"
        "def _kvroute_guarded_fake(name):\n"
        "    from torchvision.extension import _has_ops\n"
        "    if _has_ops():\n"
        "        return torch.library.register_fake(name)\n"
        "    return lambda fn: fn\n\n"
    )
    idx = text.index("@_kvroute_guarded_fake(")  # the helper goes before the first decorated function
    text = text[:idx] + guard.lstrip("\n") + "\n" + text[idx:]
    path.write_text(text, encoding="utf-8")
    print(f"patch_torchvision: guarded {sorted(set(hits))} in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
