"""Every standard way to ask whether apex is installed, answered as JSON on stdout: run under
``python -m ampddp.apex`` (apex found as installed apex 0.1) and plain (no apex anywhere)."""

import importlib.metadata as metadata
import importlib.util
import json
import subprocess
import sys

MODULES = ("apex", "apex.amp", "apex.parallel", "apex.optimizers", "apex.normalization", "apex.fp16_utils", "amp_C", "apex_C")


def asked(question):
    try:
        return question()
    except (metadata.PackageNotFoundError, ImportError) as error:
        return f"{type(error).__name__}"


def child(code):
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return done.stdout.strip() if done.returncode == 0 else f"exit {done.returncode}"


def pkg_resources_version():
    """setuptools' older API (Lightning 1.x reads it), where setuptools still ships it (< 81)."""
    try:
        import pkg_resources
    except ImportError:
        return "no pkg_resources"
    try:
        return pkg_resources.get_distribution("apex").version
    except pkg_resources.DistributionNotFound:
        return "DistributionNotFound"


answers = {
    "pkg_resources": pkg_resources_version(),
    "version": asked(lambda: metadata.version("apex")),
    "metadata": asked(lambda: [metadata.metadata("apex")["Name"], metadata.metadata("apex")["Version"]]),
    "distribution": asked(lambda: metadata.distribution("apex").version),
    "files": asked(lambda: sorted(str(path) for path in metadata.files("apex") if path.suffix == ".py")),
    "files_exist": asked(lambda: all(path.locate().is_file() for path in metadata.files("apex"))),
    "requires": asked(lambda: metadata.requires("apex")),
    "distributions": sum(dist.metadata["Name"] == "apex" for dist in metadata.distributions()),
    "packages": {name: metadata.packages_distributions().get(name) for name in ("apex", "amp_C", "apex_C")},
    "specs": {name: asked(lambda name=name: importlib.util.find_spec(name) is not None) for name in MODULES},
    "__version__": asked(lambda: __import__("apex").__version__),
    "child_version": child("import importlib.metadata as m; print(m.version('apex'))"),
    "pip_show": child("import runpy, sys; sys.argv = ['pip', 'show', 'apex']; runpy.run_module('pip', run_name='__main__')"),
}
print(json.dumps(answers))
