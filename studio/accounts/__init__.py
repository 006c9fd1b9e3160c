"""Team accounts (docs/team.md): users with argon2id passwords, their API keys, and who a request acts as.

``passwords.py`` hashes and checks passwords; ``keys.py`` makes API keys and reads them back;
``service.py`` (:class:`Accounts`) is what the CLI, the API and the UI call, over the rows of
``studio/store/accounts.py``; ``identity.py`` is the account a request or UI event acts as, and what it
may see.
"""
