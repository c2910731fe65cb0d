"""`python -m llmweb user add | remove [--purge] | list | key`: the users file from the command line.

A removed user's sessions end on a running server at their next action (web/identity.py checks that a
session's user still exists); `--purge` also deletes what they stored, as "Delete all my data" does.

It edits the file that web/accounts.py reads, through accounts.py's own functions; it must not
write the file itself, print a stored hash, or start the server. Problems raise LlmwebError
subclasses (cli/main.py prints them, exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import logging
import sys
import time
from pathlib import Path

from llmweb.chat.recall import recall_namespace
from llmweb.config import Settings, check_username
from llmweb.errors import InputError
from llmweb.retrieval.library import private_namespace
from llmweb.retrieval.storage import delete_namespace
from llmweb.store.db import Store
from llmweb.web.accounts import (
    DEFAULT_FILE_NAME,
    check_password,
    load_users,
    new_record,
    parse_auth_pairs,
    save_users,
    users_file_path,
)
from llmweb.web.api.keys import key_digest, new_api_key
from llmweb.web.identity import login_owner

STORE_FILE = "llmweb.sqlite3"  # in the data dir, as llmweb.runtime opens it

log = logging.getLogger(__name__)


def add_parser(sub) -> None:
    """Register `user add NAME | remove NAME | list` on cli/main.py's subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--file",
        type=Path,
        default=None,
        help=f"the users file (default: LLMWEB_AUTH_FILE, else <data dir>/{DEFAULT_FILE_NAME})",
    )
    u = sub.add_parser("user", help="manage login accounts (and their API keys) in the users file")
    users = u.add_subparsers(dest="user_command", metavar="{add,remove,list,key}")
    users.required = True
    a = users.add_parser("add", parents=[common], help="add a user (asks for the password)")
    a.add_argument("name")
    a.add_argument("--password-stdin", action="store_true", help="read the password from stdin (one line)")
    a.add_argument("--replace", action="store_true", help="set a new password if the user exists")
    r = users.add_parser(
        "remove", parents=[common], help="remove a user (a running server ends their sessions at once)"
    )
    r.add_argument("name")
    r.add_argument(
        "--purge",
        action="store_true",
        help="also delete everything the user stored: chats, facts and private documents",
    )
    users.add_parser("list", parents=[common], help="list users and when they were added")
    k = users.add_parser("key", parents=[common], help="make a new API key for a user (printed once)")
    k.add_argument("name")
    k.add_argument("--revoke", action="store_true", help="remove all the user's API keys instead")
    u.set_defaults(func=cmd_user)


def purge_owner(settings: Settings, owner: str) -> tuple[int, bool]:
    """Everything `owner` stored, as "Delete all my data" removes it: the store's chats and facts,
    their recall indexes, and the private library (chat/session.py's `delete_owner`, without
    loading a model). Returns (chats deleted, whether a private library was deleted)."""
    store = Store(settings.data_dir / STORE_FILE)
    try:
        ids = store.delete_owner(owner)
    finally:
        store.close()
    for conv_id in ids:
        delete_namespace(settings, recall_namespace(conv_id))
    return len(ids), delete_namespace(settings, private_namespace(owner))


def read_password(from_stdin: bool) -> str:
    if from_stdin:
        line = sys.stdin.readline()
        return line[:-1] if line.endswith("\n") else line
    first = getpass.getpass("Password: ")
    if getpass.getpass("Password again: ") != first:
        raise InputError("the two passwords differ; nothing was changed")
    return first


def cmd_user(args, settings=None) -> int:
    """`user add | remove | list`. Problems raise LlmwebError subclasses (cli/main.py prints them, exit 2)."""
    if settings is None:
        settings = Settings.from_env()
    path = users_file_path(settings, args.file)
    users = load_users(path)
    if args.user_command == "list":
        if not users:
            print(f"no users in {path}")
        for name in sorted(users):
            created = time.strftime("%Y-%m-%d %H:%M", time.localtime(users[name].created))
            n_keys = len(users[name].api_keys)
            print(f"{name}\tadded {created}" + (f"\t{n_keys} API key{'s' if n_keys != 1 else ''}" if n_keys else ""))
        return 0
    name = check_username(args.name)
    if args.user_command == "add":
        if name in users and not args.replace:
            raise InputError(f"user {name!r} already exists in {path} (use --replace to set a new password)")
        shadowed = name in parse_auth_pairs(settings.auth)
        password = check_password(read_password(args.password_stdin))
        done = "updated" if name in users else "added"
        keys = users[name].api_keys if name in users else ()
        users[name] = dataclasses.replace(new_record(name, password), api_keys=keys)
        save_users(path, users)
        log.info("user %r %s in %s", name, done, path)
        print(f"{done} user {name} in {path}")
        if shadowed:
            print(f"note: {name} is also in LLMWEB_AUTH, which wins over the file")
        if settings.auth_file is None or Path(settings.auth_file).resolve() != path.resolve():
            print(f"note: the server reads this file only with LLMWEB_AUTH_FILE={path}")
        return 0
    if args.user_command == "key":
        if name not in users:
            raise InputError(f"there is no user {name!r} in {path}; add it first (user add {name})")
        if args.revoke:
            revoked = len(users[name].api_keys)
            users[name] = dataclasses.replace(users[name], api_keys=())
            save_users(path, users)
            log.info("user %r: %d API keys revoked in %s", name, revoked, path)
            print(f"revoked {revoked} API key{'s' if revoked != 1 else ''} of {name}")
            return 0
        key = new_api_key()
        users[name] = dataclasses.replace(users[name], api_keys=users[name].api_keys + (key_digest(key),))
        save_users(path, users)
        log.info("user %r: an API key added in %s", name, path)
        print(key)
        print(f"(the API key of {name}; it is shown only now. The server reads it with LLMWEB_AUTH_FILE={path})")
        return 0
    if args.user_command == "remove":
        if name not in users:
            raise InputError(f"there is no user {name!r} in {path}")
        del users[name]
        save_users(path, users)
        log.info("user %r removed from %s", name, path)
        print(f"removed user {name} from {path}; a server reading it ends their sessions at their next action")
        if getattr(args, "purge", False):
            chats, docs = purge_owner(settings, login_owner(name))
            log.info("user %r purged: %d chats%s", name, chats, " and their documents" if docs else "")
            print(f"deleted {chats} chat{'s' if chats != 1 else ''}" + (" and their documents" if docs else ""))
        return 0
    raise InputError(f"unknown user command {args.user_command!r}")
