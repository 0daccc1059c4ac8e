"""Generated files stay in step with their sources."""

from __future__ import annotations

import subprocess
import sys

from tests.service_procs import ROOT


def test_configuration_reference_is_current():
    result = subprocess.run([sys.executable, "scripts/gen_config_docs.py", "--check"], check=False, cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_readme_links_resolve():
    readme = (ROOT / "README.md").read_text()
    for target in ("docs/configuration.md", "docs/algorithms.md", "docs/RELIABILITY.md", "deploy/README.md"):
        assert f"]({target})" in readme and (ROOT / target).is_file()
