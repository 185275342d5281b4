"""Sphinx fixes for the book's HTML (loaded through _config.yml's extra_extensions).

sphinx-thebe registers its inline configuration script once per page that has code cells, and
Sphinx keeps every registration, so from the second such page on the script appears twice and
the browser reports "Identifier 'THEBE_JS_URL' has already been declared". We drop exact
duplicates from each page's script list.
"""


def _drop_duplicate_scripts(app, pagename, templatename, context, doctree):
    seen, unique = set(), []
    for js in context.get("script_files", []):
        # a body-only script is registered with filename None by some extensions and "" by others
        key = (str(getattr(js, "filename", js) or ""), tuple(sorted(getattr(js, "attributes", {}).items())))
        if key not in seen:
            seen.add(key)
            unique.append(js)
    context["script_files"] = unique


def setup(app):
    app.connect("html-page-context", _drop_duplicate_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
