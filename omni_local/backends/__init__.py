"""What answers the API: the engine in this process (`local`), or a remote server (`remote`)."""
