"""The API reference (docs/api.md, docs/api/*.md): every name it shows works when copied.

Builds only the API pages (Sphinx's dummy builder, docs/conf.py as is) once per module and
checks what a user reads there:

- every object the pages document (``jamp.LossScaleState``, ``jamp.parallel.zero.plan``)
  resolves by ``import`` of its longest module prefix and ``getattr`` from ``jamp``, the way
  a copied ``jamp.loss_scale.LossScaleState`` would be used (``jamp.loss_scale`` is a
  function, so that one must not be documented);
- every dotted name shown in a reference or a type (``jax.Array``) resolves, and none has a
  private part (``jax.jaxlib._jax.Array``);
- each ``jamp.X`` that ``jamp`` exports is in the index, links to its entry, and is
  documented once, as ``jamp.X``;
- a NamedTuple's fields are listed once (the class docstring's Variables), not again as
  constructor parameters or as members.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import pathlib
import re
import sys

import pytest

pytest.importorskip("sphinx")
pytest.importorskip("myst_parser")
from docutils import nodes  # noqa: E402
from sphinx import addnodes  # noqa: E402
from sphinx.application import Sphinx  # noqa: E402
from sphinx.ext.autosummary import autosummary_table  # noqa: E402

import jamp  # noqa: E402

# Sphinx 9's napoleon uses autodoc's options as a mapping, deprecated for Sphinx 11.
pytestmark = pytest.mark.filterwarnings("ignore:The mapping interface for autodoc options")

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    out = tmp_path_factory.mktemp("api_reference")
    app = Sphinx(
        str(DOCS), str(DOCS), str(out / "dummy"), str(out / "doctrees"), "dummy",
        confoverrides={"root_doc": "api",
                       "exclude_patterns": ["_build", "examples", "README.md", "guides",
                                            "index.md", "changelog.md"]},
        status=None, warning=None, freshenv=True)
    app.build()
    return app


def _api_docs(app) -> list[str]:
    docs = sorted(d for d in app.env.found_docs if d == "api" or d.startswith("api/"))
    assert len(docs) >= 5, docs
    return docs


def resolve(name: str):
    """What ``import <longest module prefix>`` followed by ``<name>`` evaluates to."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        try:
            importlib.import_module(".".join(parts[:k]))
            break
        except ImportError:
            continue
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        if not hasattr(obj, part):
            raise AttributeError(f"{'.'.join(parts[:i])} is {type(obj).__name__} "
                                 f"{obj!r:.60}: it has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


@functools.cache
def check_usable(name: str, objtype: str = "obj") -> str | None:
    """None if ``name`` works when copied, else why not."""
    if any(p.startswith("_") and not (p.startswith("__") and p.endswith("__"))
           for p in name.split(".")):
        return f"{name}: private part"
    try:
        obj = resolve(name)
    except Exception as e:  # noqa: BLE001 (the message is the finding)
        return f"{name}: {type(e).__name__}: {e}"
    if (objtype == "module") != inspect.ismodule(obj):
        return f"{name}: documented as {objtype}, is {type(obj).__name__}"
    return None


def test_resolve_rejects_a_name_shadowed_by_a_function():
    """The rule the tests below apply, on the name the issue reported."""
    assert check_usable("jamp.loss_scale.LossScaleState") is not None
    assert check_usable("jamp.loss_scale", "module") is not None
    assert check_usable("jax.jaxlib._jax.Array") is not None
    assert check_usable("jamp.LossScaleState") is None
    assert check_usable("jamp.loss_scale", "function") is None
    assert check_usable("jamp.parallel.zero", "module") is None
    assert check_usable("jax.Array") is None


def test_every_documented_object_resolves(app):
    api = set(_api_docs(app))
    objects = app.env.get_domain("py").objects
    shown = {name: entry.objtype for name, entry in objects.items()
             if entry.docname in api and not entry.aliased}
    assert len(shown) > 300, len(shown)
    bad = [why for name, objtype in sorted(shown.items())
           if (why := check_usable(name, objtype))]
    assert not bad, "\n".join(bad)


def _dotted(text: str) -> str | None:
    text = text.strip().removesuffix("()")
    return text if re.fullmatch(r"[A-Za-z_]\w*(\.\w+)+", text) else None


# How the docstrings write names relative to a convention (``nn.Module``).
ALIASES = {"nn": "flax.linen", "nnx": "flax.nnx", "jnp": "jax.numpy", "np": "numpy"}


def check_reference(name: str, objtype: str, module: str | None, cls: str | None):
    """A name that starts with a package (``jamp.``, ``jax.``) must work as written; one
    written relative to the module or class it appears in (``TrainState.after_update``),
    or to a base class's module (an inherited signature), must work there."""
    head, _, rest = name.partition(".")
    if head in ALIASES:
        return check_usable(f"{ALIASES[head]}.{rest}", objtype)
    if importlib.util.find_spec(head) is not None:
        return check_usable(name, objtype)
    contexts = [c for c in (module and cls and f"{module}.{cls}", module) if c]
    if module and cls and inspect.isclass(owner := resolve(f"{module}.{cls}")):
        contexts += [base.__module__ for base in owner.__mro__[1:]]
    whys = [check_usable(f"{c}.{name}", objtype) for c in contexts]
    return None if None in whys else f"{name} (in {module}): not found"


def test_every_dotted_reference_and_type_resolves(app):
    bad, seen = set(), 0
    for doc in _api_docs(app):
        for ref in app.env.get_doctree(doc).findall(addnodes.pending_xref):
            if ref.get("refdomain") != "py" or not (name := _dotted(ref.astext())):
                continue
            seen += 1
            objtype = "module" if ref.get("reftype") == "mod" else "obj"
            if why := check_reference(name, objtype, ref.get("py:module"), ref.get("py:class")):
                bad.add(f"{doc}: {why}")
    assert seen > 100, seen
    assert not bad, "\n".join(sorted(bad))


def _context_lookup(text: str, module: str | None, cls: str | None):
    """The object a reference's text names where it is written, or None."""
    for path in filter(None, (module and cls and f"{module}.{cls}.{text}",
                              module and f"{module}.{text}", text)):
        parts = path.split(".")
        for k in range(len(parts), 0, -1):
            if (obj := sys.modules.get(".".join(parts[:k]))) is not None:
                try:
                    for part in parts[k:]:
                        obj = getattr(obj, part)
                except AttributeError:
                    break
                return obj
    return None


def test_references_to_exports_are_links(app):
    """``:func:`scale_loss``` in jamp.loss_scale's docstring, a type hint naming
    ``jamp.loss_scale.LossScaleState``: each links to the ``jamp.X`` entry."""
    exports = {id(getattr(jamp, n)): n for n in jamp.__all__}
    unlinked, linked = set(), 0
    for doc in _api_docs(app):
        doctree = app.env.get_doctree(doc)
        for ref in doctree.findall(addnodes.pending_xref):
            if ref.get("refdomain") == "py" and ref.children and (export := exports.get(id(
                    _context_lookup(ref["reftarget"].lstrip("~."), ref.get("py:module"),
                                    ref.get("py:class"))))):
                if isinstance(ref[0], nodes.Text):
                    ref[0] = nodes.inline("", ref[0].astext())
                ref[0]["names_export"] = export  # kept by the copy the resolver links
        app.env.apply_post_transforms(doctree, doc)
        for node in doctree.findall(lambda n: isinstance(n, nodes.Element)
                                    and "names_export" in n.attributes):
            parent = node.parent
            while parent is not None and not isinstance(parent, nodes.reference):
                parent = parent.parent
            if parent is None:
                unlinked.add(f"{doc}: {node.astext()} (jamp.{node['names_export']})")
            else:
                linked += 1
    assert linked > 50, linked
    assert not unlinked, "\n".join(sorted(unlinked))


def test_exports_are_indexed_linked_and_documented_once(app):
    objects = app.env.get_domain("py").objects
    doctree = app.env.get_doctree("api")
    app.env.apply_post_transforms(doctree, "api")  # resolves the references
    index = {}
    for table in doctree.findall(autosummary_table):
        for row in table.findall(nodes.row):
            first = row.children[0]
            index[first.astext().strip()] = bool(list(first.findall(nodes.reference)))
    exported = set(jamp.__all__)
    assert set(index) == exported, (set(index) ^ exported)
    assert all(index.values()), [n for n, linked in index.items() if not linked]
    for name in exported:
        entry = objects.get(f"jamp.{name}")
        assert entry is not None and not entry.aliased, f"jamp.{name} is not documented"
        obj = getattr(jamp, name)
        # documented once: no second entry under its defining module
        home = getattr(obj, "__module__", None)
        if home and home.startswith("jamp.") and not inspect.ismodule(obj):
            twin = objects.get(f"{home}.{obj.__qualname__}")
            assert twin is None or twin.aliased, f"{name} also documented as {home}"


def test_namedtuple_fields_listed_once(app):
    objects = app.env.get_domain("py").objects
    api = set(_api_docs(app))
    checked = []
    for name, entry in objects.items():
        if entry.docname not in api or entry.aliased or entry.objtype != "class":
            continue
        cls = resolve(name)
        if not (issubclass(cls, tuple) and hasattr(cls, "_fields")):
            continue
        checked.append(name)
        assert not [f for f in cls._fields if f"{name}.{f}" in objects], name
        doc = app.env.get_doctree(entry.docname)
        [signature] = [s for s in doc.findall(addnodes.desc_signature) if name in s["ids"]]
        content = signature.parent.children[-1]
        fields = {f.children[0].astext(): f.children[1] for f in content.findall(nodes.field)
                  if f.parent.parent is content}
        listings = [f for f in ("Variables", "Parameters") if f in fields]
        assert len(listings) == 1, f"{name}: fields listed under {listings}"
        # One field is rendered as a paragraph, several as a list.
        items = ([i.astext() for i in fields[listings[0]].findall(nodes.list_item)]
                 or [fields[listings[0]].astext()])
        assert sorted(i.split(" ", 1)[0] for i in items) == sorted(cls._fields), (name, items)
    assert "jamp.LossScaleState" in checked and len(checked) >= 3, checked
