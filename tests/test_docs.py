"""The README is a front page and the rest is a documentation site (issue 28): the README stays
short, its links and the site's nav name pages that exist, every `feeder` command it shows is
one the real CLI accepts, and the site builds in MkDocs's strict mode, where a broken link fails."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from feeder.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def mkdocs_build(root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(root / "mkdocs.yml"), "--site-dir", str(site)], capture_output=True, text=True,
                          timeout=120, env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})


def test_the_readme_is_a_front_page():
    assert len(README.splitlines()) <= 250
    for words in ("make demo", "make test", "Quick start: trainer author", "Quick start: feeder operator",
                  "Quick start: data engineer", "What we guarantee", "Where to read more"):
        assert words in README, words


def nav_pages(nav) -> list[str]:
    out = []
    for item in nav:
        for value in item.values():
            out += nav_pages(value) if isinstance(value, list) else [value]
    return out


def test_links_and_nav_name_pages_that_exist_and_every_page_is_in_the_nav():
    for link in re.findall(r"\]\(([^)#]+)", README):
        assert (ROOT / link).is_file(), link
    cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = nav_pages(cfg["nav"])
    assert sorted(pages) == sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert "scale.md" in pages


def shown_commands(text: str) -> list[str]:
    """The `feeder ...` commands of a page's bash blocks (continuations joined), without the
    synopses (`[--flag X]`, `INPUT...`, `HOST:PORT`), which say what may be given."""
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            m = re.search(r"(?:^|&& |; )(feeder .*?)(?: &&|;|$)", line.split("  #")[0].strip())
            if m and not re.search(r"\[|\||…|\.\.\.|[A-Z]{3,}", m.group(1)):
                cmds.append(m.group(1))
    return cmds


def test_every_feeder_command_the_readme_and_the_docs_show_is_one_the_cli_accepts():
    readme = shown_commands(README)
    assert len(readme) >= 6
    cmds = readme + [c for page in sorted((ROOT / "docs").glob("*.md")) for c in shown_commands(page.read_text())]
    for cmd in cmds:
        argv = shlex.split(cmd)[1:]
        try:
            build_parser(argv).parse_args(argv)
        except SystemExit:
            pytest.fail(f"the README shows a command the CLI refuses: {cmd}")


def test_the_site_builds_in_strict_mode_and_a_broken_link_fails_it(tmp_path):
    r = mkdocs_build(ROOT, tmp_path / "site")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "site" / "security" / "index.html").is_file()
    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    with open(copy / "docs" / "client.md", "a") as f:
        f.write("\nSee [the missing page](no-such-page.md).\n")
    r = mkdocs_build(copy, tmp_path / "site2")
    assert r.returncode != 0 and "no-such-page.md" in r.stderr
