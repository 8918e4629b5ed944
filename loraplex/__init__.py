"""The `loraplex` command: the composition root that joins the rooms (gateway, engine, bench, migrations) and
builds the embedded demo model. Nothing below it imports it."""
