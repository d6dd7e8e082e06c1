"""The README's set-up commands are the ones CI and users run."""

import pathlib
import re

README = (pathlib.Path(__file__).parents[1] / "README.md").read_text()


def test_readme_opens_with_the_two_set_up_commands():
    blocks = re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)
    main_job, tests = blocks[0], blocks[1]
    assert "pip install" in main_job and "keras-dp train" in main_job
    assert "pip install" in tests and "pytest" in tests
    marker = README.index("<!-- test-command -->")
    assert README[marker:].split("```bash\n", 1)[1].startswith(tests)
