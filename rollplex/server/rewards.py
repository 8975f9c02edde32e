"""The rewards a /train_step request may name: those registered when the server started.

    rewards = RewardRegistry(default="default", modules=("geo=my_rewards:geo",), allow_client_code=False)
    rewards.get("geo")           # the function; ValueError (-> 400) for a name that is not registered

Registered: the built-ins of rollplex/rl/rewards.py (`default`, `exact`, `choice`, `math_boxed`,
`geo3k`, `shape_color`), the server's `--reward` (a name, `module:function` or `FILE.py:function`),
and each `--reward-module [NAME=]module:function` (repeatable; under NAME when given, and under its
path). Code is imported from the operator's command line only, once, at startup.

A request naming anything else gets 400 with the registered names, and nothing is imported: a path
in a request (`os:system`, `/tmp/x.py:fn`) is not run. `--allow-client-reward-code` lifts that for
servers whose every client may run code on the host (it is logged as a warning at startup): then a
request's `module:function` / `FILE.py:function` is imported when it is named.
"""

from __future__ import annotations

import logging
import re
import threading

from ..rl.rewards import REGISTRY, RewardFn, default_compute_score, load_reward

log = logging.getLogger("rollplex.server")
_NAME = re.compile(r"[\w.-]+")


class RewardRegistry:
    def __init__(self, default: str = "default", modules: tuple[str, ...] = (), allow_client_code: bool = False):
        self.fns: dict[str, RewardFn] = {"default": default_compute_score, **REGISTRY}
        self.allow_client_code = allow_client_code
        self._lock = threading.Lock()  # requests' own paths are loaded from worker threads
        self.default = self.register(default)  # /train_step without `reward` or `rewards`
        for spec in modules:
            self.register(spec)
        if allow_client_code:
            log.warning("--allow-client-reward-code: /train_step requests may name module:function or FILE.py:function "
                        "rewards, which this server imports and runs with its own rights; give it only to clients "
                        "you would give a shell on this host")

    def register(self, spec: str) -> RewardFn:
        """`NAME=PATH`, `PATH` (module:function or FILE.py:function) or a registered name; the function."""
        name, sep, path = spec.partition("=")
        if not sep or ":" not in path or not _NAME.fullmatch(name):  # no NAME= prefix ('=' inside a path)
            name, path = spec, spec
        if path in self.fns:
            fn = self.fns[path]
        elif ":" in path:
            fn = load_reward(path)  # the operator's code, imported once
            log.info("reward %r registered (%s)", name, path)
        else:
            raise ValueError(f"unknown reward {path!r}: give a built-in ({', '.join(self.names())}), "
                             "module:function or FILE.py:function")
        self.fns[path] = self.fns[name] = fn
        return fn

    def names(self) -> list[str]:
        return sorted(self.fns)

    def get(self, name: str) -> RewardFn:
        fn = self.fns.get(name)
        if fn is not None:
            return fn
        if ":" in name and self.allow_client_code:
            log.warning("running the client-named reward %r (--allow-client-reward-code)", name)
            with self._lock:
                return load_reward(name)
        hint = (" A request cannot name code for the server to run: start the server with "
                f"--reward-module {name} to register it (or send `rewards`)." if ":" in name else "")
        raise ValueError(f"unknown reward {name!r}; this server scores only the rewards registered at startup: "
                         f"{', '.join(self.names())}.{hint}")
