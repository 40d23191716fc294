"""griffe extension: show the API reference as a user reads it, not as the code is written.

griffe reads the sources, and mkdocstrings shows what it read. Four things it reads are
code, not documentation; once the package is loaded, this extension rewrites them (the sources
are not changed):

- An attribute set in a method (``self.options = CheckpointerOptions(**{...})`` in
  ``__init__``) is shown with that method's code as its value. Such values are dropped: the
  attribute keeps its annotation and docstring; one set from a parameter of ``__init__``
  (``self.path = path``) and not annotated takes the parameter's annotation.
- A dataclass field's default written as ``field(default_factory=KeepAll)`` or
  ``field(default_factory=lambda: FixedInterval(interval=1))`` is shown as that call, and the
  class's signature shows the lambda. The default is shown as the value it makes
  (``KeepAll()``, ``FixedInterval(interval=1)``); ``field(default=x)`` as ``x``. Only fields
  whose ``field()`` says nothing else that changes the class (``repr=``, ``compare=``,
  ``hash=``, ``metadata=`` may be said) are rewritten (griffe's dataclass extension, which runs
  after this one, then reads them as plain defaults).
- A class attribute set to a module's constant (``typestr = fmt.PYTREE_HANDLER_TYPESTR``) is
  shown through a private module's name; it is shown as the constant's literal value (a tuple
  of them, as the tuple of their values).
- A parameter or field annotated with a private module's type alias (``path: PathLike``, where
  ``milepost._api`` says ``PathLike = str | os.PathLike[str] | ObjectPath``) names a type the
  reader cannot look up; the alias is shown as what it stands for.

tests/test_docstrings.py loads the package with the same extensions and checks what they give.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_FIELD_ARGS = {"default", "default_factory"}
_SHOWN_ONLY = {"repr", "compare", "hash", "metadata"}
"""Arguments of ``field()`` that change neither the signature nor the default."""


def _objects(obj: griffe.Object) -> list[griffe.Object]:
    """``obj`` and every object defined in it (aliases are not followed)."""
    found = [obj]
    for member in obj.members.values():
        if not member.is_alias:
            found.extend(_objects(member))  # type: ignore[arg-type]
    return found


def _set_in_method(attr: griffe.Attribute) -> bool:
    """Whether ``attr``'s value comes from a method's body (``self.x = ...``)."""
    return "instance-attribute" in attr.labels and "class-attribute" not in attr.labels


def _field_default(value: Any) -> str | griffe.Expr | None:
    """What a ``field(default=...)`` or ``field(default_factory=...)`` makes; None when the
    value is not such a call, or its ``field()`` says more."""
    if not isinstance(value, griffe.ExprCall) or str(value.function) not in {
        "field",
        "dataclasses.field",
    }:
        return None
    keywords = {a.name: a.value for a in value.arguments if isinstance(a, griffe.ExprKeyword)}
    made = set(keywords) & _FIELD_ARGS
    if len(keywords) != len(value.arguments) or len(made) != 1:
        return None
    if not set(keywords) - made <= _SHOWN_ONLY:  # (init=False and the like change the class)
        return None
    if "default" in keywords:
        return keywords["default"]
    factory = keywords["default_factory"]
    if isinstance(factory, griffe.ExprLambda):
        return factory.body
    return griffe.ExprCall(function=factory, arguments=[])  # type: ignore[arg-type]


def _constant(value: Any, pkg: griffe.Module) -> str | None:
    """The literal value of the package's constant ``value`` names, if it names one (or of
    each, for a tuple of such names)."""
    if isinstance(value, griffe.ExprTuple) and value.elements:
        literals = [_constant(element, pkg) for element in value.elements]
        if None in literals:
            return None
        return f"({', '.join(literals)}{',' if len(literals) == 1 else ''})"  # type: ignore[arg-type]
    if not isinstance(value, griffe.ExprName | griffe.ExprAttribute):
        return None
    try:
        target = pkg.modules_collection.get_member(value.canonical_path)
    except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None
    if target.is_alias:
        try:
            target = target.final_target
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None
    literal = getattr(target, "value", None) if target.is_attribute else None
    return literal if isinstance(literal, str) else None


def _private_alias(name: griffe.ExprName) -> str | None:
    """What ``name`` stands for, if it names a type alias of a private module."""
    path = name.canonical_path
    if not path.startswith("milepost.") or not any(p.startswith("_") for p in path.split(".")):
        return None
    try:
        target = name.parent.modules_collection.get_member(path)  # type: ignore[union-attr]
        target = target.final_target if target.is_alias else target
    except (AttributeError, KeyError, ValueError, griffe.AliasResolutionError):
        return None
    alias = target.is_attribute and target.parent is not None and target.parent.is_module
    if alias and isinstance(target.value, griffe.ExprBinOp | griffe.ExprSubscript):
        return str(target.value)
    return None


def _expand_aliases(annotation: Any) -> Any:
    """``annotation`` with each private type alias written out (a string then), else as is."""
    if not isinstance(annotation, griffe.Expr):
        return annotation
    names = [n for n in annotation.iterate(flat=True) if isinstance(n, griffe.ExprName)]
    meaning = {n.name: m for n in names if (m := _private_alias(n)) is not None}
    if not meaning:
        return annotation
    pattern = re.compile(rf"(?<![\w.])({'|'.join(map(re.escape, meaning))})(?![\w])")
    return pattern.sub(lambda m: meaning[m.group(1)], str(annotation))


def _parameter_annotation(attr: griffe.Attribute) -> Any:
    """The annotation of the ``__init__`` parameter ``attr`` is set from, if it is one."""
    init = attr.parent.members.get("__init__") if attr.parent is not None else None
    if init is None or init.is_alias or not isinstance(attr.value, griffe.ExprName):
        return None
    for parameter in init.parameters:  # type: ignore[union-attr]
        if parameter.name == attr.value.name:
            return parameter.annotation
    return None


class ReferenceView(griffe.Extension):
    """Rewrite the loaded package as the module's docstring says."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for obj in _objects(pkg):
            if obj.is_function:
                for parameter in obj.parameters:  # type: ignore[attr-defined]
                    parameter.annotation = _expand_aliases(parameter.annotation)
                obj.returns = _expand_aliases(obj.returns)  # type: ignore[attr-defined]
            if obj.is_attribute:
                obj.annotation = _expand_aliases(obj.annotation)  # type: ignore[attr-defined]
                self._attribute(obj, pkg)  # type: ignore[arg-type]

    @staticmethod
    def _attribute(attr: griffe.Attribute, pkg: griffe.Module) -> None:
        if attr.parent is None or not attr.parent.is_class or attr.value is None:
            return
        if _set_in_method(attr):
            if attr.annotation is None:
                attr.annotation = _parameter_annotation(attr)
            attr.value = None
        elif (default := _field_default(attr.value)) is not None:
            attr.value = default
        elif (literal := _constant(attr.value, pkg)) is not None:
            attr.value = literal
