"""Sphinx configuration of jamp's docs: guides in Markdown (MyST), an API reference from
the docstrings (autodoc + napoleon, Google style).

Build: ``pip install -e ".[docs]" && sphinx-build -W --keep-going -b html docs docs/_build/html``.
"""

import ast
import collections
import importlib.util
import inspect
import os
import pathlib
import re
import sys
import types
import warnings

from docutils import nodes
from sphinx import addnodes
from sphinx.pycode import ModuleAnalyzer
from sphinx.util import typing as _sphinx_typing
from sphinx.util.nodes import make_refnode

sys.path.insert(0, os.path.abspath(".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "jamp"
author = "the jamp authors"
copyright = "2026, the jamp authors"  # noqa: A001 (Sphinx's name)
extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "examples", "README.md"]
myst_heading_anchors = 3
autosummary_generate = True
autodoc_typehints = "description"
autodoc_member_order = "bysource"
# A package documents what it defines; re-exports are documented where they are defined.
autodoc_default_options = {"members": True, "show-inheritance": True, "ignore-module-all": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # NamedTuple fields: documented once, by the class docstring
html_theme = "furo"
html_title = "jamp"

# --------------------------------------------------------------------------------------
# The API reference documents every object under a dotted path that works when copied.
#
# What ``jamp`` exports is documented once, as ``jamp.X``, right after the docstring of the
# module it is exported from (_document_exports). The module's own member list skips it
# (_skip_member). ``jamp.loss_scale`` and ``jamp.autocast`` are functions that shadow their
# modules (``import jamp.loss_scale`` works, ``jamp.loss_scale.LossScaleState`` does not), so
# those two modules get no index entry and what they hold besides the exports is shown
# without a module prefix, under a ``from jamp.<module> import ...`` heading (_SHADOWED).
# jamp's runtime objects are untouched: ``__module__`` stays the defining module, so
# ``typing.get_type_hints``, pickling and ``from jamp.loss_scale import ...`` are unchanged.
# tests/test_api_reference.py builds these pages and resolves every name they document.

import flax.linen  # noqa: E402
import jax  # noqa: E402
import jmp  # noqa: E402
import optax  # noqa: E402

import jamp  # noqa: E402

_EXPORTS = {name: getattr(jamp, name) for name in jamp.__all__
            if not inspect.ismodule(getattr(jamp, name))}
_PUBLIC_NAME = {id(obj): f"jamp.{name}" for name, obj in _EXPORTS.items()}


def _exported_from() -> dict[str, list[str]]:
    """{module: [names jamp exports]}: the module that defines the name if jamp imports
    anything from it, else the one jamp/__init__.py imports the name from."""
    tree = ast.parse(pathlib.Path(jamp.__file__).read_text())
    sources = {(a.asname or a.name): node.module for node in tree.body
               if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jamp.")
               for a in node.names if (a.asname or a.name) in _EXPORTS}
    owners: dict[str, list[str]] = collections.defaultdict(list)
    for name, source in sources.items():
        home = getattr(_EXPORTS[name], "__module__", None)
        owners[home if home in sources.values() else source].append(name)
    return owners


_EXPORTED_FROM = _exported_from()
_OWNER = {f"jamp.{n}": module for module, names in _EXPORTED_FROM.items() for n in names}
_SHADOWED = {f"jamp.{name}" for name, obj in _EXPORTS.items()
             if importlib.util.find_spec(f"jamp.{name}") is not None}


def _directive(obj) -> str:
    if inspect.isclass(obj):
        return "autoexception" if issubclass(obj, BaseException) else "autoclass"
    return "autofunction" if inspect.isroutine(obj) else "autodata"


def _document_exports(app, what, name, obj, options, lines):
    """Appends ``.. autoX:: jamp.N`` for each name jamp exports from module ``name``."""
    owner = _OWNER.get(name) if what != "module" else None
    if owner:  # jamp.N = <value> keeps the docstring written under it in its module
        attr_doc = ModuleAnalyzer.for_module(owner).find_attr_docs().get(("", name[5:]))
        if attr_doc:
            lines[:] = list(attr_doc)
        return
    if what != "module" or not getattr(options, "members", None) or name not in _EXPORTED_FROM:
        return
    order = ModuleAnalyzer.for_module(name).tagorder
    names = sorted(_EXPORTED_FROM[name], key=lambda n: order.get(n, len(order)))
    for export in names:
        lines += ["", f".. {_directive(_EXPORTS[export])}:: jamp.{export}"]
        if isinstance(_EXPORTS[export], types.UnionType):
            lines += ["   :no-value:"]  # its docstring names the union in public terms


_TUPLE_FIELD = type(collections.namedtuple("_T", "x").x)


def _skip_member(app, what, name, obj, skip, options):
    if what == "module" and _EXPORTS.get(name, _TUPLE_FIELD) is obj:
        return True  # documented as jamp.<name>
    if isinstance(obj, _TUPLE_FIELD):
        return True  # a NamedTuple field: listed once, by the class docstring's Attributes
    return None


def _annotations(env) -> dict:
    document = getattr(env, "current_document", None)  # Sphinx >= 8.2
    if document is not None and hasattr(document, "autodoc_annotations"):
        return document.autodoc_annotations
    return env.temp_data.get("annotations", {})


def _namedtuple_signature(app, what, name, obj, options, args, retann):
    """A NamedTuple's constructor parameters are its fields: when its docstring lists them
    (Attributes:), don't list them again as Parameters."""
    if what == "class" and inspect.isclass(obj) and issubclass(obj, tuple) \
            and hasattr(obj, "_fields") and "Attributes:" in (obj.__doc__ or ""):
        _annotations(app.env).pop(name, None)


def _lookup(path: str):
    """The object at ``path``, starting from the longest prefix that is a loaded module."""
    parts = path.split(".")
    for k in range(len(parts), 0, -1):
        module = sys.modules.get(".".join(parts[:k]))
        if module is not None:
            obj = module
            for part in parts[k:]:
                obj = getattr(obj, part)
            return obj
    raise LookupError(path)


def _public_xref(app, env, node, contnode):
    """Resolves a reference written in the defining module's terms (``:func:`scale_loss```
    inside jamp.loss_scale, a type hint ``jamp.step.TrainState``) to the ``jamp.X`` entry."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~.")
    module = node.get("py:module")
    shadowed = next((m for m in _SHADOWED if target.startswith(f"{m}.")), None)
    for path in ([f"{module}.{target}"] if module else []) + [target]:
        try:
            obj = _lookup(path)
        except (AttributeError, LookupError):
            continue
        if public := _PUBLIC_NAME.get(id(obj)):
            return env.get_domain("py").resolve_xref(
                env, node["refdoc"], app.builder, "obj", public, node, contnode)
        if getattr(obj, "__module__", None) in _SHADOWED:
            shadowed = obj.__module__
            break
    if shadowed:  # an unindexed ``from jamp.autocast import rewrite``: its module's section
        label = "api-" + shadowed.replace(".", "-").replace("_", "-")
        docname, label_id, _ = env.get_domain("std").labels[label]
        return make_refnode(app.builder, node["refdoc"], docname, label_id, contnode)
    return None


def _public_class_name(match: re.Match) -> str:
    try:
        cls = _lookup(match[1])
    except (AttributeError, LookupError):
        return match[0]
    return _CLASS_NAMES.get((cls.__module__, cls.__qualname__), match[1])


def _public_signature(app, domain, objtype, contentnode):
    """``from jamp.autocast import rewrite`` objects are shown as ``rewrite(...)``; class
    reprs in values (``<class 'jamp.loss_scale.LossScaleDivergedError'>``) by public name."""
    for signature in contentnode.parent.findall(addnodes.desc_signature):
        if signature.get("module") in _SHADOWED:
            for prefix in list(signature.findall(addnodes.desc_addname)):
                prefix.parent.remove(prefix)
        for text in list(signature.findall(nodes.Text)):
            public = re.sub(r"<class '([\w.]+)'>", _public_class_name, text)
            if public != text:
                text.parent.replace(text, nodes.Text(public))


def _linen_signature(app, what, name, obj, options, args, retann):
    """A linen Module's ``parent`` and ``name`` are Flax's, not the class's fields."""
    if what == "class" and inspect.isclass(obj) and issubclass(obj, flax.linen.Module) and args:
        args = re.sub(r", parent=<[^>]*>", "", args).replace(", name=None)", ")")
        return args, retann
    return None


# Public names for classes whose __module__/__qualname__ is a private home: jax.Array is
# jaxlib._jax.Array, jmp.Policy is jmp._src.policy.Policy, and jamp's exports print as
# jamp.X, not as their defining module. Sphinx keeps this table for the same problem in
# the standard library (contextvars, io, pathlib...); Sphinx 7 named it without the "_".
_CLASS_NAMES = getattr(_sphinx_typing, "_INVALID_BUILTIN_CLASSES", None)
if _CLASS_NAMES is None:
    _CLASS_NAMES = _sphinx_typing.INVALID_BUILTIN_CLASSES


def _public_class_names(*modules) -> None:
    """Adds ``(__module__, __qualname__) -> module.name`` for the classes ``modules`` export
    from a private home (and for every class jamp exports); the first module wins."""
    with warnings.catch_warnings():  # optax's deprecated aliases warn on getattr
        warnings.simplefilter("ignore")
        for module in modules:
            for name in getattr(module, "__all__", dir(module)):
                obj = getattr(module, name, None)
                if inspect.isclass(obj) and (
                        module is jamp or "._" in f".{obj.__module__}.{obj.__qualname__}"):
                    _CLASS_NAMES.setdefault((obj.__module__, obj.__qualname__),
                                            f"{module.__name__}.{name}")


_public_class_names(jamp, jax, jax.sharding, jax.typing, jax.stages, jax.tree_util, optax, jmp)
# Annotations that name the alias (not its expansion) print as the alias.
autodoc_type_aliases = {"PolicyLike": "jamp.PolicyLike"}
html_static_path = ["_static"]
html_css_files = ["api.css"]


def setup(app):
    app.connect("autodoc-process-docstring", _document_exports)
    app.connect("autodoc-skip-member", _skip_member)
    app.connect("autodoc-process-signature", _namedtuple_signature)
    app.connect("missing-reference", _public_xref)
    app.connect("object-description-transform", _public_signature)
    app.connect("autodoc-process-signature", _linen_signature)
