"""stepbundle.schema imports the standard library and msgpack only."""

from __future__ import annotations

import subprocess
import sys

FORBIDDEN = ("torch", "torch_xla", "jax", "jaxlib", "numpy")

SCRIPT = f"""
import sys
FORBIDDEN = {FORBIDDEN!r}

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in FORBIDDEN:
            raise ImportError(f"{{name}} is blocked in this test")
        return None

sys.meta_path.insert(0, Block())
import stepbundle.schema
import stepbundle.schema.reader, stepbundle.schema.writer, stepbundle.schema.validate, stepbundle.schema.describe, stepbundle.schema.rng, stepbundle.schema.atomic
loaded = sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN)
assert not loaded, loaded
stepbundle.schema.describe.describe()
print("ok")
"""


def test_schema_imports_without_torch_jax_numpy() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
