--
-- catalog_lock.sql: a function's first look at idempotency.keys in a
-- (sub)transaction locks the table for the rest of it, and later calls
-- trust that lock instead of taking it again.  So the lock belongs to the
-- transaction, not to the statement or cursor that happened to run the
-- call: a cursor that fails and is closed must not take it along, or a
-- concurrent REINDEX CONCURRENTLY could drop an index the session still
-- believes in.
--
BEGIN;
DECLARE c CURSOR FOR
	SELECT v.k, (SELECT count(*) FROM idempotency.idem_lookup(v.k, 'catalog_lock')) AS stored
	  FROM (VALUES ('a', 1), ('b', 0)) v(k, d) WHERE 1 / v.d > 0;
FETCH 1 FROM c;
SAVEPOINT s;
-- the second row fails before its call: the cursor fails
FETCH 1 FROM c;
ROLLBACK TO s;
CLOSE c;
-- the table is still locked by this transaction
SELECT mode, granted FROM pg_locks
 WHERE relation = 'idempotency.keys'::regclass AND pid = pg_backend_pid();
SELECT outcome, attempt FROM idempotency.idem_claim('after', scope => 'catalog_lock');
COMMIT;
-- and released with it
SELECT count(*) AS locks_left FROM pg_locks
 WHERE relation = 'idempotency.keys'::regclass AND pid = pg_backend_pid();

-- a lock taken inside a subtransaction that rolls back is gone with it:
-- the next call takes it again
BEGIN;
SAVEPOINT s;
SELECT status FROM idempotency.idem_lookup('after', 'catalog_lock');
SELECT count(*) AS locked_in_savepoint FROM pg_locks
 WHERE relation = 'idempotency.keys'::regclass AND pid = pg_backend_pid();
ROLLBACK TO s;
SELECT count(*) AS locked_after_rollback FROM pg_locks
 WHERE relation = 'idempotency.keys'::regclass AND pid = pg_backend_pid();
SELECT status FROM idempotency.idem_lookup('after', 'catalog_lock');
SELECT mode, granted FROM pg_locks
 WHERE relation = 'idempotency.keys'::regclass AND pid = pg_backend_pid();
COMMIT;
-- leave nothing of this scope pending for the tests after this one
DELETE FROM idempotency.keys WHERE scope = 'catalog_lock';
