"""The words every layer shares, at the bottom of the import graph: what a request holds (messages,
sampling and speech parameters), what a reply streams back (events), the model family's kinds, and
the `Backend` interface that the facade (api/) calls and backends/ implement. It imports no engine,
no backend and no front end, so the engine and a page on a remote backend speak it alike."""
