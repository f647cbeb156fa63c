"""What `pip install .` installs: one top-level package, grpo (rewards/ and data/ inside it as grpo.rewards
and grpo.data), so that a user's own rewards, data or common package imports beside ours."""

import json
import shutil
import subprocess
import sys
import zipfile

import pytest
from conftest import REPO

IMPORTS_FROM_THE_WHEEL = '''
import json, sys
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in type(f).__module__ + getattr(f, "__name__", "")]
sys.path[:0] = [sys.argv[1], sys.argv[2]]  # the unpacked wheel, then the user's folder
import common, data, rewards  # the user's own
import grpo.common.jail, grpo.data.embedded, grpo.rewards.builtins
from grpo.data.embedded import read_embedded_jsonl
print(json.dumps({"user": [common.MINE, data.MINE, rewards.MINE], "grpo": grpo.__file__,
                  "rewards": grpo.rewards.builtins.__file__, "rows": read_embedded_jsonl("test").count(b"\\n")}))
'''


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel pip builds from the checkout's tracked files (copied: a build writes build/ beside them)."""
    tree, out = tmp_path_factory.mktemp("tree"), tmp_path_factory.mktemp("wheel")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (REPO / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, tree / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(tree)], check=True, capture_output=True, timeout=300)
    return next(out.glob("*.whl"))


def test_the_wheel_holds_grpo_alone_with_every_package_of_the_checkout(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")} == {"grpo"}
    packages = {str(p.parent.relative_to(REPO)) for p in REPO.glob("*/**/__init__.py")
                if p.parts[len(REPO.parts)] in ("grpo", "rewards", "data")}
    installed = {name.rsplit("/", 1)[0] for name in names if name.endswith("/__init__.py")}
    expected = {p if p.startswith("grpo") else f"grpo/{p}" for p in packages}
    assert installed == expected  # a package the list in pyproject.toml lacks would be missing
    assert {"grpo/data/embedded/gsm8k/test.jsonl.gz", "grpo/model/templates/chatml_tools.jinja"} <= set(names)


def test_a_users_own_rewards_data_and_common_import_beside_the_installed_grpo(wheel, tmp_path):
    unpacked, user = tmp_path / "site", tmp_path / "user"
    zipfile.ZipFile(wheel).extractall(unpacked)
    for name in ("common", "data", "rewards"):
        (user / name).mkdir(parents=True)
        (user / name / "__init__.py").write_text(f'MINE = "the user\'s {name}"\n')
    out = subprocess.run([sys.executable, "-c", IMPORTS_FROM_THE_WHEEL, str(unpacked), str(user)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout)
    assert found["user"] == ["the user's common", "the user's data", "the user's rewards"]
    assert found["grpo"] == str(unpacked / "grpo" / "__init__.py")
    assert found["rewards"] == str(unpacked / "grpo" / "rewards" / "builtins.py") and found["rows"] == 1319


def test_a_checkout_on_the_python_path_without_an_install_imports_grpo_rewards_and_data(tmp_path):
    """A Python without this project installed (no site: no editable finder), the checkout on PYTHONPATH,
    as a vLLM environment of its own runs the sampler: grpo.rewards and grpo.data are the folders beside grpo/."""
    import site

    code = ("import sys; sys.path.extend(sys.argv[1:]); import grpo.rewards.overlong, grpo.data.embedded; "
            "print(grpo.rewards.overlong.__file__, grpo.data.embedded.__file__)")
    out = subprocess.run([sys.executable, "-S", "-c", code, *site.getsitepackages()], cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [str(REPO / "rewards" / "overlong.py"), str(REPO / "data" / "embedded.py")]
