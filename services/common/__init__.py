"""Runtime pieces every role uses: the socket factory, reply routing and the process lifecycle."""
