"""Build hook: ship the C++ sources of csrc/ inside the wheel as hanzo_torch/_csrc/.

All metadata lives in pyproject.toml. The CPU extension is compiled from these sources on first
use (hanzo_torch/backends/cpu); an editable install reads csrc/ in the checkout directly.
"""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class build_py_with_csrc(build_py):
    def run(self):
        super().run()
        src = Path(__file__).resolve().parent / "csrc"
        if src.is_dir() and not self.editable_mode:
            shutil.copytree(src, Path(self.build_lib) / "hanzo_torch" / "_csrc", dirs_exist_ok=True)


setup(cmdclass={"build_py": build_py_with_csrc})
