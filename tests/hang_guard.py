"""How long a test waits for something that should happen (a process to finish, a server to answer, an
event to be set) before it calls it a hang. Never a speed: a test passes however slowly a loaded
machine runs it, so the bound is far beyond any such run; it exists only so that a real hang fails the
test instead of CI."""

HANG_S = 600.0
