"""The UI's event handlers, one module per panel of the page; web/ui.py builds the page and wires
each component's events to them.

  base.py       what every panel shares: `Panel` (the components that show one conversation),
                `PanelHandlers` (who is asking, filling a `Panel` from the store) and `user_errors`
                (a domain error becomes a `gr.Error` toast: the one place in llmweb that does this)
  chat.py       the chat: send, regenerate, continue, edit, undo, the version switcher, after Stop
  chats.py      the list of chats: new, open, search, rename, delete
  memory.py     the memory panel: add, pin, unpin and delete a fact
  settings.py   this chat's settings: save them, the documents checkbox
  transfer.py   export a chat (.md, .json) and import a .json export
  documents.py  the documents accordion: the list, upload, remove
  sources.py    the source panel: a cited source opened beside the chat, its passage in its document
  account.py    the visit (a new browser's owner token) and "Delete all my data"
  endpoints.py  the gradio_client endpoints (/chat, /stats) and the status line

Handlers return values and updates; they must not build components, decide what goes into a
prompt or how anything is stored (chat/, store/ and retrieval/ do), or work out an owner
themselves (web/identity.py does). What is shown is made by web/formatting.py.
"""
