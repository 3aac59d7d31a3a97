"""`Registry`, the one type behind every extension point: names, import paths, and what a wrong one is told."""

from __future__ import annotations

import pytest

from baton.algorithms import grpo
from baton.config import ConfigError, Registry


def widgets() -> Registry:
    registry = Registry("widget")

    @registry.register("alpha")
    def alpha():
        return "a"

    registry["beta"] = len
    return registry


def test_names_registered_by_decorator_and_by_item():
    registry = widgets()
    assert registry.get("alpha")() == "a" and registry["beta"] is len
    assert registry.names() == ["alpha", "beta"] == list(registry) and len(registry) == 2
    assert "alpha" in registry and "gamma" not in registry
    assert registry.pop("beta") is len and "beta" not in registry


def test_a_typo_is_told_the_nearest_name_and_the_import_path_form():
    with pytest.raises(ValueError) as info:
        widgets().get("alhpa")
    message = str(info.value)
    assert message.startswith("unknown widget 'alhpa'; valid: ['alpha', 'beta'] ")
    assert "or an import path 'package.module:attr'" in message and message.endswith("did you mean 'alpha'?")
    with pytest.raises(ConfigError, match=r"^algo.widget 'zzz' is not one of \['alpha', 'beta'\] or an import path "
                                          r"'package.module:attr'$"):  # nothing close: no hint
        widgets().get("zzz", key="algo.widget")


def test_an_import_path_names_any_object():
    assert widgets().get("baton.algorithms.advantages:grpo") is grpo
    assert widgets().get("baton.config.registry:Registry.get") is Registry.get


USER_WIDGETS = Registry("widget")  # what the user module below registers in


def test_a_name_the_user_module_registers_works_once_its_path_imported_it(tmp_path, monkeypatch):
    (tmp_path / "userwidgets.py").write_text(f"from {__name__} import USER_WIDGETS\n\n"
                                             "@USER_WIDGETS.register('mine')\n"
                                             "def mine():\n    return 'mine'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "mine" not in USER_WIDGETS
    fn = USER_WIDGETS.get("userwidgets:mine")  # importing the module registers it
    assert fn() == "mine" and USER_WIDGETS.get("mine") is fn
    USER_WIDGETS.pop("mine")


def test_an_unknown_module_or_attribute_names_the_registry_and_the_cause():
    with pytest.raises(ConfigError, match=r"^widget 'no_such_module:f' cannot be imported: no module named "
                                          r"'no_such_module' \(modules are found beside the config file"):
        widgets().get("no_such_module:f")
    with pytest.raises(ConfigError, match=r"^algo.widget: widget 'baton.algorithms.advantages:grop' cannot be "
                                          r"imported: 'baton.algorithms.advantages' has no attribute 'grop'; did you "
                                          r"mean 'grpo'\?"):
        widgets().get("baton.algorithms.advantages:grop", key="algo.widget")
    with pytest.raises(ConfigError, match="not of the form 'package.module:Name'"):
        widgets().get("baton.algorithms:")


def test_a_module_that_fails_its_own_import_is_not_reported_as_missing(tmp_path, monkeypatch):
    (tmp_path / "brokenwidgets.py").write_text("import no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency"):
        widgets().get("brokenwidgets:f")


def test_registering_a_name_twice_or_a_name_with_a_colon_fails():
    registry = widgets()
    with pytest.raises(ValueError, match="widget 'alpha' is already registered; pick another name"):
        registry.register("alpha")(len)
    with pytest.raises(ValueError, match="widget 'beta' is already registered"):
        registry["beta"] = len
    with pytest.raises(ValueError, match="holds ':', which marks an import path"):
        registry["a:b"] = len
    assert registry.get("alpha")() == "a"  # the first registration stands


def test_an_entry_given_as_an_import_path_is_imported_when_first_used():
    registry = Registry("widget", {"grpo": "baton.algorithms.advantages:grpo", "gone": "baton.algorithms:nothing"})
    assert registry.names() == ["gone", "grpo"] and registry.get("grpo") is grpo
    with pytest.raises(ConfigError, match="widget 'gone' cannot be imported: 'baton.algorithms' has no attribute"):
        registry.get("gone")
