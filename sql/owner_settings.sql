--
-- owner_settings.sql: code a DBA attached to idempotency.keys runs in the
-- extension's write section, which leaves the caller's session exactly as
-- it found it: a trigger's SET or set_config(..., false) ends with the
-- write (as in PostgreSQL's own restricted sections), and every row of a
-- sweep or batch is written with search_path pinned to pg_catalog, pg_temp
-- even when an earlier row's trigger changed it.
--
\set VERBOSITY sqlstate

CREATE TABLE public.seen_settings (n serial, op text, key text, path text, work_mem text);
-- the table's triggers write here with its owner's rights
DO $$ BEGIN EXECUTE format('GRANT SELECT, INSERT ON public.seen_settings TO %1$s; GRANT USAGE ON SEQUENCE public.seen_settings_n_seq TO %1$s', (SELECT c.relowner::regrole FROM pg_class c
    WHERE c.oid = 'idempotency.keys'::regclass)); END $$;
CREATE FUNCTION public.keys_change_settings() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
	k text := CASE WHEN TG_OP = 'DELETE' THEN OLD.key ELSE NEW.key END;
BEGIN
	INSERT INTO public.seen_settings (op, key, path, work_mem)
		VALUES (TG_OP, k, pg_catalog.current_setting('search_path'),
		        pg_catalog.current_setting('work_mem'));
	PERFORM pg_catalog.set_config('search_path', 'public', false);
	PERFORM pg_catalog.set_config('work_mem', '7MB', false);
	EXECUTE 'SET statement_timeout = 12345';
	RETURN NULL;
END $$;
CREATE TRIGGER keys_change_settings AFTER INSERT OR UPDATE OR DELETE ON idempotency.keys
	FOR EACH ROW EXECUTE FUNCTION public.keys_change_settings();

SET search_path = public, pg_catalog;
SET work_mem = '4MB';
-- a claim, a finish, a batch of three, each in autocommit
SELECT outcome FROM idempotency.idem_claim('s1', scope => 'owner-settings');
SHOW search_path;
SHOW work_mem;
SHOW statement_timeout;
SELECT count(*) AS claimed FROM idempotency.idem_claim_many(ARRAY['s2', 's3', 's4'],
	scope => 'owner-settings', retention => '1 millisecond') WHERE outcome = 'claimed';
SHOW search_path;
SHOW work_mem;
-- inside a transaction too
BEGIN;
SELECT idempotency.idem_finish(k.key, k.token, 200, NULL, 'owner-settings',
                               retention => '1 millisecond') IS NOT NULL AS finished
  FROM (SELECT key, token FROM idempotency.keys WHERE scope = 'owner-settings'
         ORDER BY key) k;
SHOW search_path;
SHOW work_mem;
COMMIT;
SHOW statement_timeout;

-- the sweep deletes the four expired keys in one write section: each
-- row's trigger saw the pinned path, not what the previous row's set
SELECT pg_sleep(0.01);
SELECT expired FROM idempotency.idem_sweep();
SHOW search_path;
SHOW work_mem;
SELECT op, key, path, work_mem FROM public.seen_settings ORDER BY n;

RESET search_path;
RESET work_mem;
DROP TRIGGER keys_change_settings ON idempotency.keys;
DROP FUNCTION public.keys_change_settings();
DROP TABLE public.seen_settings;
DELETE FROM idempotency.keys WHERE scope = 'owner-settings';
