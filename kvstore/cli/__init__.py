"""The `kvstore` command line (entry point `kvstore.cli.main:main`).

    main.py         argument parsing: every subcommand, its help, and the dispatch to its function
    commands.py     one function per simple subcommand: `(client, args) -> exit code`
    render.py       everything printed: rich tables for people, one JSON document for scripts (`--json`)
    top.py          `kvstore top`: a live view from two successive Client.stats() snapshots
    inspect_cmd.py  `kvstore inspect`: where keys live (tier, node) and how much of a chain is stored
    events_cmd.py   `kvstore events`: the daemon's KV events, one line or JSON object each
    explain_cmd.py  `kvstore explain`: block by block, where each key of a request lives, or why it missed
    hint_cmd.py     `kvstore hint`: an agent's hint (retain, release, demote, prefetch, pin) on blocks, per-block outcomes
    sessions_cmd.py `kvstore sessions`: the daemon's session book (what `explain --session` explains)
    score_cmd.py    `kvstore score`: per live node, a prompt's leading tokens in its RAM, on its disk, from peers
    keys_input.py   the blocks a command is about: hex keys, a keys file, or token ids keyed like the connector

Nothing is imported here on purpose: `python -m kvstore.cli.main` would otherwise find the module already
imported by its package and warn.
"""
