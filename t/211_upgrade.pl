
# Copyright: the idempotency extension authors.
#
# 211_upgrade.pl: ALTER EXTENSION idempotency UPDATE from every released
# version to the newest (the control file's default_version), driven by one
# table of the released versions and what each has.
#
# What it proves, for each released version:
#   - CREATE EXTENSION idempotency VERSION '<v>' installs it, and the newest
#     library serves it as it is: claim, finish, lookup and the stats view
#     work, and before 1.4 a checkpoint (the C function declared by hand) is
#     refused with 55000 rather than written nowhere;
#   - a database with keys in every state that version can store (finished
#     with a response, failed, pending under a live lease, pending with an
#     expired lease, a bound tenant's pending key, and from 1.4 on a key at a
#     recovery point and keys claimed and finished in batches) updates
#     without touching a stored row (same ctid and xmin, every column), a
#     scope binding, or the token sequence;
#   - after the update: finished keys replay, a different request is a
#     mismatch, the live key is in progress and its owner extends,
#     checkpoints and finishes it with the token from before the update, the
#     stale key is taken over (attempt 2, a larger token), its old token is
#     dead (55006), and a third attempt resumes from the second's recovery
#     point; a recovery point stored before is still there; batches and
#     session-bound claims work; statements another session prepared before
#     the update still run; idem_version() names the newest version; the
#     tenant is still confined to its prefix; a key claimed and finished
#     with remember answers expired once its retention has passed, a
#     different request mismatch, the sweep keeps its outcome and drops its
#     response, and idem_forget lets it run again; a key claimed with
#     keep_request whose lease ended is taken over by idem_claim_abandoned,
#     which returns its request; unbind_scope answers true,
#     then false; distribute() without Citus raises 55000 and changes
#     nothing; cluster_stats answers one row, node 'local';
#   - a dump taken before the update restores into the newest version with
#     every key as it was;
#   - in a read-only transaction every function that writes, the
#     administrator's included, raises 25006 and changes nothing;
#   - the updated catalog is a fresh install's, definition for definition,
#     owners and privileges included, and no role dependency of initial
#     privileges outlives them.
# With an administrator's privileges (EXECUTE on idem_claim revoked from
# PUBLIC and granted per role, one grant by a role holding the grant option;
# on idem_lookup, stats_counters and unbind_scope; SELECT and an option on
# the stats view), updated by another superuser: the privileges, grantors
# and owners are the same after the update, the granted roles use them and
# others are refused, none of them is recorded as initial privileges, a
# dump carries them, every definition is a fresh install's, and once the
# grants are revoked the roles can be dropped.
# With a user's view and BEGIN ATOMIC function on idem_claim and a view on
# the stats view: the update to the newest version creates idem_claim anew
# (from every released version), so it fails with 2BP01 and leaves the old
# version working and unchanged; dropped, updated and created again, they
# work.
# On PostgreSQL 17 and later: a database that the first release of the 1.0
# to 1.1 update left with role dependencies of initial privileges that no
# initial privileges back is repaired by the update, and DROP ROLE works
# again.
#
# Run it like the other TAP tests (see the top of t/001_restart.pl).  Port
# 55477 only names the socket file.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

skip_sql_edition(
	'the versions it updates from (1.0 to 1.5) are the C edition\'s; the SQL '
	  . 'edition begins at 1.6 (sql-edition/versions) and has no earlier release');

# Every released version: whether it has recovery points and batches (1.4
# on), and whether the update from it creates idem_claim anew (a function's
# arguments or result cannot change in place: 1.0 to 1.1, 1.3 to 1.4,
# 1.6 to 1.7 and 1.7 to 1.8 drop it), so that a user's object on idem_claim
# stops the update.
my @released = (
	{ version => '1.0', since_1_4 => 0, claim_recreated => 1 },
	{ version => '1.1', since_1_4 => 0, claim_recreated => 1 },
	{ version => '1.2', since_1_4 => 0, claim_recreated => 1 },
	{ version => '1.3', since_1_4 => 0, claim_recreated => 1 },
	{ version => '1.4', since_1_4 => 1, claim_recreated => 1 },
	{ version => '1.5', since_1_4 => 1, claim_recreated => 1 },
	{ version => '1.6', since_1_4 => 1, claim_recreated => 1 },
	{ version => '1.7', since_1_4 => 1, claim_recreated => 1 },);

# No sweeps: no key's sweep_at moves while the test compares rows.
my $node = new_node('upgrade', port => 55477,
	init => [ extra => [ '--encoding=UTF8', '--locale=C' ] ],
	conf => ['idempotency.sweep_interval = 0']);

sub sql { my ($db, $sql) = @_; return $node->safe_psql($db, $sql); }

my $current = sql('postgres',
	"SELECT default_version FROM pg_available_extensions WHERE name = 'idempotency'");
like($current, qr/^\d+\.\d+$/, "the newest version is $current");
ok(!grep({ $_->{version} eq $current } @released),
	"$current is not one of the released versions the table updates from");

sql('postgres', 'CREATE ROLE regress_up_tenant');

sub ext_version
{
	my ($db) = @_;
	return sql($db, "SELECT extversion FROM pg_extension WHERE extname = 'idempotency'");
}

# Every stored key as key_rows gives it, without where the tuple is (ctid,
# xmin): what a dump and restore keeps.
sub key_columns
{
	my ($db) = @_;
	(my $rows = key_rows($node, $db)) =~ s/^[^|]*\|[^|]*\|//mg;
	return $rows;
}

my $bindings_sql =
    "SELECT string_agg(concat_ws('|', ctid, xmin, role, scope_prefix), E'\\n' "
  . "ORDER BY role::text) FROM idempotency.scope_bindings";
my $seq_sql = 'SELECT last_value FROM idempotency.token_seq';
my $view_defs_sql =
    "SELECT string_agg(c.oid::regclass || E':\\n' || pg_get_viewdef(c.oid), E'\\n' "
  . "ORDER BY c.oid::regclass::text) FROM pg_class c "
  . "WHERE c.relnamespace = 'idempotency'::regnamespace AND c.relkind = 'v'";
# The definitions of the extension's functions, without owner or privileges.
my $function_defs_sql =
    "SELECT string_agg(pg_get_functiondef(p.oid), E'\\n' ORDER BY p.oid::regprocedure::text) "
  . "FROM pg_proc p JOIN pg_depend d ON d.classid = 'pg_proc'::regclass AND d.objid = p.oid "
  . "WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e' "
  . "AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency')";
my $key_counts_sql =
    "SELECT concat_ws(',', pending, succeeded, failed) FROM idempotency.stats "
  . "WHERE database = current_database()";
# cluster_stats: "how many rows|their nodes|whether each row, without its
# node, is this database's stats row|whether the counters counted", read
# in one statement.
my $cluster_stats_sql =
    "SELECT concat_ws('|', count(*), string_agg(c.node, ','), "
  . "bool_and(to_jsonb(c) - 'node' = (SELECT to_jsonb(s) FROM idempotency.stats s "
  . "WHERE s.database = current_database())), bool_and(c.claims > 0 AND c.finishes > 0)) "
  . "FROM idempotency.cluster_stats c";

# Every call that writes, by the newest version's signatures.  In a
# read-only transaction each must raise 25006.
my @writers = (
	"SELECT * FROM idempotency.idem_claim('ro')",
	"SELECT * FROM idempotency.idem_claim_many('{ro1,ro2}')",
	"SELECT idempotency.idem_finish('live', 1, 200)",
	"SELECT * FROM idempotency.idem_finish_many('{live}', '{1}')",
	"SELECT idempotency.idem_extend('live', 1, '1 hour')",
	"SELECT idempotency.idem_release('live', 1)",
	"SELECT idempotency.idem_checkpoint('live', 1, 'p')",
	'SELECT * FROM idempotency.idem_sweep()',
	"SELECT idempotency.bind_scope('regress_up_tenant', 'x:')",
	"SELECT idempotency.unbind_scope('regress_up_tenant')",
	'SELECT idempotency.distribute()');

my $done_body   = q{'{"id": 1, "items": ["a", "b"]}'};
my $failed_body = q{'{"error": "card declined"}'};
my %md5 = (
	done   => body_md5($node, 'postgres', $done_body),
	failed => body_md5($node, 'postgres', $failed_body));
my $dumps = PostgreSQL::Test::Utils::tempdir;

# =========================================================================
# A fresh install of the newest version, to compare with
# =========================================================================
sql('postgres', 'CREATE DATABASE fresh');
sql('fresh', 'CREATE EXTENSION idempotency');
is(ext_version('fresh'), $current, "fresh: CREATE EXTENSION installs $current");
my %catalog = catalog_queries();
$catalog{'view definitions'} = $view_defs_sql;
my %fresh;
$fresh{$_} = sql('fresh', $catalog{$_}) foreach keys %catalog;
$fresh{'function definitions'} = sql('fresh', $function_defs_sql);
isnt($fresh{$_}, '', "fresh: $_: the query finds something") foreach sort keys %fresh;

# =========================================================================
# Each released version: install, fill, update, use the old keys
# =========================================================================
foreach my $rel (@released)
{
	my $from = $rel->{version};
	(my $db = "up_$from") =~ s/\./_/;
	sql('postgres', "CREATE DATABASE $db");
	sql($db, "CREATE EXTENSION idempotency VERSION '$from'");
	is(ext_version($db), $from, "$db: CREATE EXTENSION ... VERSION '$from' installs $from");
	sql($db, 'GRANT USAGE ON SCHEMA idempotency TO regress_up_tenant');

	# --- keys in every state this version can store --------------------------
	my (%tok, @bt);
	foreach my $key (qw(done failed live stale))
	{
		my $lease = $key eq 'stale' ? '1 millisecond' : '1 hour';
		my $c = claim($node, $db, qq{'$key', request => '{"k": "$key"}', lease => '$lease'});
		is("$c->{outcome},$c->{attempt}", 'claimed,1', "$db: $key is claimed under $from");
		$tok{$key} = $c->{token};
	}
	sql($db, "SELECT idempotency.idem_finish('done', $tok{done}, 201, $done_body)");
	sql($db, "SELECT idempotency.idem_finish('failed', $tok{failed}, 402, $failed_body, "
		  . "status => 'failed')");
	sql($db, "SELECT idempotency.bind_scope('regress_up_tenant', 'tenant:')");
	my $c = claim($node, $db, q{'t1', scope => 'tenant:a', lease => '1 hour'},
		role => 'regress_up_tenant');
	is($c->{outcome}, 'claimed', "$db: the bound tenant claims in its prefix under $from");
	$tok{t1} = $c->{token};
	if ($rel->{since_1_4})
	{
		$c = claim($node, $db, q{'cp', lease => '1 hour'});
		$tok{cp} = $c->{token};
		is( sqlstate_of($node, $db,
				"SELECT idempotency.idem_checkpoint('cp', $tok{cp}, 'charged', '{\"id\": 7}')"),
			'00000', "$db: cp is at a recovery point under $from");
		my $batch = sql($db,
			    "SELECT string_agg(outcome || ':' || token, ',' ORDER BY key) "
			  . "FROM idempotency.idem_claim_many('{b1,b2}', lease => '1 hour')");
		like($batch, qr/^claimed:\d+,claimed:\d+$/, "$db: a batch claims b1 and b2 under $from");
		@bt = $batch =~ /:(\d+)/g;
		is( sql($db,
				"SELECT count(*) FROM idempotency.idem_finish_many('{b1}', '{$bt[0]}')"),
			'1', "$db: and finishes b1 in a batch");
		$tok{b2} = $bt[1];
	}
	else
	{
		# A checkpoint has nowhere to go in a table of this version: the C
		# function, declared by hand, refuses it (55000) and changes nothing.
		sql($db, 'CREATE FUNCTION public.checkpoint_by_hand(text, bigint, text, jsonb, text) '
			  . "RETURNS void AS '\$libdir/idempotency', 'idem_checkpoint' LANGUAGE C");
		my $before = key_rows($node, $db);
		is( sqlstate_of($node, $db,
				"SELECT public.checkpoint_by_hand('live', $tok{live}, 'step', NULL, '')"),
			'55000', "$db: a checkpoint under $from is refused (55000)");
		is(key_rows($node, $db), $before, "$db: and changes no key");
		sql($db, 'DROP FUNCTION public.checkpoint_by_hand(text, bigint, text, jsonb, text)');
	}
	is( sql($db, "SELECT concat_ws(',', status, attempt, response_code, md5(response_body::text)) "
			  . "FROM idempotency.idem_lookup('done')"),
		"succeeded,1,201,$md5{done}", "$db: lookup under $from");
	is(sql($db, $key_counts_sql), $rel->{since_1_4} ? '5,2,1' : '3,1,1',
		"$db: the stats view counts the keys under $from");
	# The stale key's lease has passed once its own lease_until has.
	sql($db, "SELECT pg_sleep_until(lease_until) FROM idempotency.keys "
		  . "WHERE scope = '' AND key = 'stale'");

	# Another session prepares statements under this version and keeps them.
	my $session = $node->background_psql($db);
	$session->query_safe(
		    'PREPARE replay_done AS SELECT outcome, response_code FROM '
		  . q{idempotency.idem_claim('done', '{"k": "done"}')});
	$session->query_safe(
		    'PREPARE claim_new(text) AS SELECT outcome, attempt FROM '
		  . "idempotency.idem_claim(\$1, lease => '1 hour')");
	is($session->query_safe('EXECUTE replay_done'), 'replay|201',
		"$db: a statement prepared under $from replays done");

	# A dump names no extension version: it restores into the newest.
	$node->command_ok(
		[ 'pg_dump', '-Fc', '-d', $node->connstr($db), '-f', "$dumps/$db.dump" ],
		"$db: pg_dump under $from");

	my $rows     = key_rows($node, $db);
	my $dumped   = key_columns($db);
	my $bindings = sql($db, $bindings_sql);
	my $seq      = sql($db, $seq_sql);

	# --- the update ----------------------------------------------------------
	is(sqlstate_of($node, $db, 'ALTER EXTENSION idempotency UPDATE'), '00000',
		"$db: ALTER EXTENSION idempotency UPDATE from $from succeeds");
	is(ext_version($db), $current, "$db: updated to $current");
	is(key_rows($node, $db), $rows,
		"$db: every stored key is the same tuple (ctid, xmin), column for column");
	is(sql($db, $bindings_sql), $bindings, "$db: every binding is the same tuple");
	is(sql($db, $seq_sql), $seq, "$db: the token sequence did not move");
	is( sql($db, "SELECT split_part(idempotency.idem_version(), '.', 1) || '.' || "
			  . "split_part(idempotency.idem_version(), '.', 2)"),
		$current, "$db: idem_version() names the version the database is at now");

	# --- read-only transactions: every writer refused, nothing changed ------
	foreach my $call (@writers)
	{
		is(sqlstate_of($node, $db, "BEGIN READ ONLY; $call"), '25006',
			"$db: in a read-only transaction: $call raises 25006");
	}
	is(key_rows($node, $db), $rows, "$db: the refused calls changed no key");
	is(sql($db, $bindings_sql), $bindings, "$db: nor a binding");

	# --- distribute() without Citus ----------------------------------------
	foreach my $arg ('', '4', 'NULL')
	{
		my ($state, $out, $err) = sql_result($node, $db, "SELECT idempotency.distribute($arg)");
		is($state, '55000', "$db: distribute($arg) without Citus raises 55000");
		like($err, qr/extension "citus" is not installed in this database/,
			"$db: distribute($arg) says Citus is missing");
	}
	is( sqlstate_of($node, $db,
			'SET ROLE regress_up_tenant; SELECT idempotency.distribute()'),
		'42501', "$db: a role with USAGE on the schema may not call distribute()");
	is(key_rows($node, $db), $rows, "$db: distribute() changed no key");
	is(sql($db, $bindings_sql), $bindings, "$db: nor a binding");
	is(sql($db, $seq_sql), $seq, "$db: nor the token sequence");
	is(sql($db, "SELECT count(*) FROM pg_extension WHERE extname = 'citus'"),
		'0', "$db: and created no citus extension");

	# --- the old keys ----------------------------------------------------------
	is($session->query_safe('EXECUTE replay_done'), 'replay|201',
		"$db: the statement prepared under $from still replays done");
	is_deeply(claim($node, $db, q{'done', request => '{"k": "done"}'}),
		replay_row('succeeded', 201, $md5{done}), "$db: done replays its stored response");
	is_deeply(claim($node, $db, q{'failed', request => '{"k": "failed"}'}),
		replay_row('failed', 402, $md5{failed}), "$db: failed replays its stored failure");
	is_deeply(claim($node, $db, q{'done', request => '{"k": "other"}'}), mismatch_row(),
		"$db: done with another request is a mismatch");
	$c = claim($node, $db, q{'live', request => '{"k": "live"}'});
	is($c->{outcome} . ',' . ($c->{token} // 'NULL'), 'in_progress,NULL',
		"$db: live is in progress under its old lease");
	is(sqlstate_of($node, $db, "SELECT idempotency.idem_extend('live', $tok{live}, '2 hours')"),
		'00000', "$db: the owner of live extends it with its old token");
	is( sqlstate_of($node, $db,
			"SELECT idempotency.idem_checkpoint('live', $tok{live}, 'half', '{\"n\": 1}')"),
		'00000', "$db: and checkpoints it with that token");
	is(sqlstate_of($node, $db, "SELECT idempotency.idem_finish('live', $tok{live}, 200)"),
		'00000', "$db: and finishes it with that token");
	is( sql($db, "SELECT concat_ws(',', status, attempt, token, response_code, phase) "
			  . "FROM idempotency.keys WHERE scope = '' AND key = 'live'"),
		"succeeded,1,$tok{live},200,half",
		"$db: live succeeded at attempt 1 with that token, its last phase kept");

	# The stale key: taken over, checkpointed, taken over again.
	# Every token issued before: those the test saw, and those stored.  (With
	# the library preloaded the sequence stands at the end of a block, not
	# at the last token.)
	my $issued = sql($db, 'SELECT max(token) FROM idempotency.keys');
	$issued = $_ > $issued ? $_ : $issued for values %tok;
	$c = claim($node, $db, q{'stale', request => '{"k": "stale"}', lease => '1 second'});
	is("$c->{outcome},$c->{attempt}", 'claimed,2', "$db: stale is taken over: attempt 2");
	cmp_ok($c->{token}, '>', $issued, "$db: with a token above every token issued before");
	my $row = stored_row($node, $db, '', 'stale');
	is(sqlstate_of($node, $db, "SELECT idempotency.idem_finish('stale', $tok{stale}, 200)"),
		'55006', "$db: the token from before the takeover is dead (55006)");
	is( sqlstate_of($node, $db, "SELECT idempotency.idem_checkpoint('stale', $tok{stale}, 'x')"),
		'55006', "$db: and may not checkpoint (55006)");
	is(stored_row($node, $db, '', 'stale'), $row, "$db: which changed nothing");
	sql($db, "SELECT idempotency.idem_checkpoint('stale', $c->{token}, 'charged', "
		  . "'{\"charge\": \"ch_9\"}')");
	ok(wait_lease_over($node, $db, '', 'stale'), "$db: the lease of the takeover has ended");
	is( sql($db,
			    "SELECT concat_ws(',', outcome, attempt, phase, phase_data->>'charge', "
			  . "idempotency.idem_finish('stale', token, 200) IS NOT NULL) "
			  . "FROM idempotency.idem_claim('stale', request => '{\"k\": \"stale\"}')"),
		'claimed,3,charged,ch_9,t',
		"$db: attempt 3 resumes from attempt 2's recovery point and finishes");

	if ($rel->{since_1_4})
	{
		is( sql($db, "SELECT concat_ws(',', status, phase) FROM idempotency.idem_lookup('cp')"),
			'pending,charged', "$db: cp is still at its recovery point");
		is(sqlstate_of($node, $db, "SELECT idempotency.idem_finish('cp', $tok{cp}, 200)"),
			'00000', "$db: and is finished with its old token");
		is( sql($db,
				"SELECT string_agg(key, ',') FROM idempotency.idem_finish_many('{b2}', '{$tok{b2}}')"),
			'b2', "$db: b2 is finished in a batch with its old token");
		is( sql($db,
				    "SELECT string_agg(concat_ws(':', key, status, token), ',' ORDER BY key) "
				  . "FROM idempotency.keys WHERE key IN ('b1', 'b2')"),
			"b1:succeeded:$bt[0],b2:succeeded:$tok{b2}",
			"$db: both batch keys succeeded with their own tokens");
	}

	# --- what later versions add, on the updated database ---------------------
	is($session->query_safe("EXECUTE claim_new('after')"), 'claimed|1',
		"$db: the claim prepared under $from claims a new key");
	$session->quit;
	is( sql($db,
			    "SELECT string_agg(format('%s:%s:%s:%s', ord, key, outcome, response_code), ' ' "
			  . "ORDER BY ord) FROM idempotency.idem_claim_many("
			  . "ARRAY['n1', 'done', 'n2', 'n1'], "
			  . "ARRAY['{\"k\": 1}', '{\"k\": \"done\"}', NULL, '{\"k\": 1}']::jsonb[])"),
		'1:n1:claimed: 2:done:replay:201 3:n2:claimed: 4:n1:in_progress:',
		"$db: idem_claim_many answers each element");
	is( sql($db,
			    "SELECT string_agg(ord || ':' || f.key, ' ' ORDER BY ord) "
			  . "FROM idempotency.idem_finish_many(ARRAY['n1', 'n2'], "
			  . "ARRAY(SELECT token FROM idempotency.keys WHERE key IN ('n1', 'n2') ORDER BY key), "
			  . "ARRAY[200, 204]) AS f"),
		'1:n1 2:n2', "$db: idem_finish_many finishes both");

	# A session-bound claim: its psql ends right after, and the next claim
	# takes over once the session's binding lock has gone.
	$c = claim($node, $db, "'bound', lease => '1 hour', session_bound => true");
	is($c->{outcome}, 'claimed', "$db: a session-bound claim");
	ok( $node->poll_query_until($db,
			    "SELECT NOT EXISTS (SELECT FROM pg_locks WHERE locktype = 'advisory' "
			  . "AND objsubid = 7656 AND database = (SELECT oid FROM pg_database "
			  . "WHERE datname = current_database()))"),
		"$db: its session has ended");
	$c = claim($node, $db, "'bound', lease => '1 hour'");
	is("$c->{outcome},$c->{attempt}", 'claimed,2', "$db: the next claim takes it over at once");

	is(sql($db, $cluster_stats_sql), '1|local|t|t',
		"$db: cluster_stats: one row, node local, this database's stats row");
	is(sql($db, "SET ROLE regress_up_tenant; $cluster_stats_sql"), '1|local|t|t',
		"$db: a role with USAGE on the schema reads the same");

	# --- the tenant bound before the update ----------------------------------
	$rows = key_rows($node, $db);
	$seq  = sql($db, $seq_sql);
	my @refused = (
		'a claim in another scope' =>
		  "SELECT * FROM idempotency.idem_claim('t2', scope => 'other')",
		'a claim in the default scope' => "SELECT * FROM idempotency.idem_claim('t2')",
		'a lookup in the default scope' => "SELECT * FROM idempotency.idem_lookup('done')",
		'a finish of its key under another scope' =>
		  "SELECT idempotency.idem_finish('t1', $tok{t1}, 200, NULL, 'other')");
	while (my ($what, $call) = splice(@refused, 0, 2))
	{
		is(sqlstate_of($node, $db, "SET ROLE regress_up_tenant; $call"), '42501',
			"$db: the tenant bound under $from is refused $what (42501)");
	}
	is(key_rows($node, $db), $rows, "$db: the refused calls changed no key");
	is(sql($db, $seq_sql), $seq, "$db: and drew no token");
	is( sqlstate_of($node, $db,
			    "SET ROLE regress_up_tenant; "
			  . "SELECT idempotency.idem_finish('t1', $tok{t1}, 200, NULL, 'tenant:a')"),
		'00000', "$db: and finishes its key with its old token");
	is(sql($db, "SELECT idempotency.unbind_scope('regress_up_tenant')"), 't',
		"$db: unbind_scope deletes the binding made under $from: true");
	is(sql($db, "SELECT idempotency.unbind_scope('regress_up_tenant')"), 'f',
		"$db: a second time: false");
	is(sql($db, 'SELECT idempotency.unbind_scope(NULL) IS NULL'), 't',
		"$db: unbind_scope(NULL) is NULL (STRICT)");

	# --- a remembered key, on the updated database --------------------------
	$c = claim($node, $db, q{'rem', request => '{"k": "rem"}', remember => '30 days'});
	sql($db, "SELECT idempotency.idem_finish('rem', $c->{token}, 201, $done_body)");
	# past its retention without waiting for the clock
	sql($db, "UPDATE idempotency.keys SET expires_at = now() - interval '1 second', "
		  . "sweep_at = now() - interval '1 second' WHERE key = 'rem'");
	is( sql($db, "SELECT concat_ws(',', outcome, token, status, response_code, response_body) "
			  . "FROM idempotency.idem_claim('rem', request => '{\"k\": \"rem\"}')"),
		'expired,succeeded,201', "$db: a remembered key past its retention answers expired");
	is( sql($db, "SELECT outcome FROM idempotency.idem_claim('rem', request => '{\"k\": 2}')"),
		'mismatch', "$db: a different request on it: mismatch");
	sql($db, 'SELECT * FROM idempotency.idem_sweep()');
	is( sql($db,
			    "SELECT concat_ws(',', status, response_code, fingerprint IS NOT NULL, "
			  . "response_body IS NULL, sweep_at = expires_at + remember) "
			  . "FROM idempotency.keys WHERE key = 'rem'"),
		'succeeded,201,t,t,t',
		"$db: the sweep keeps its outcome and fingerprint and drops its response");
	is( sql($db, "SELECT concat_ws(',', status, response_code, "
			  . "remembered_until = expires_at + interval '30 days') "
			  . "FROM idempotency.idem_lookup('rem')"),
		'succeeded,201,t', "$db: idem_lookup shows it with remembered_until");
	is(sql($db, "SELECT idempotency.idem_forget('rem')"), 't', "$db: idem_forget removes it");
	is(sql($db, "SELECT outcome FROM idempotency.idem_claim('rem', request => '{\"k\": 2}')"),
		'claimed', "$db: and it runs again");

	# --- an abandoned key and its completer, on the updated database --------
	$c = claim($node, $db,
		q{'job', request => '{"k": "job"}', lease => '1 hour', keep_request => true});
	is($c->{outcome}, 'claimed', "$db: a claim keeps its request");
	# its lease ended, without waiting for the clock
	sql($db, "UPDATE idempotency.keys SET lease_until = now() - interval '1 second', "
		  . "sweep_at = now() - interval '1 second' WHERE key = 'job'");
	is( sql($db, "SELECT concat_ws(',', key, attempt, token > $c->{token}, request) "
			  . "FROM idempotency.idem_claim_abandoned()"),
		'job,2,t,{"k": "job"}',
		"$db: idem_claim_abandoned takes it over with its request and a larger token");
	is(sqlstate_of($node, $db, "SELECT idempotency.idem_extend('job', $c->{token})"),
		'55006', "$db: the abandoned attempt's token is dead");

	# --- the dump taken before the update ------------------------------------
	sql('postgres', "CREATE DATABASE ${db}_copy");
	$node->command_ok(
		[
			'pg_restore', '--exit-on-error', '-d', $node->connstr("${db}_copy"),
			"$dumps/$db.dump"
		],
		"${db}_copy: the dump taken under $from is restored");
	is(ext_version("${db}_copy"), $current, "${db}_copy: as $current, the newest");
	is(key_columns("${db}_copy"), $dumped, "${db}_copy: every key is restored, column for column");
	is_deeply(claim($node, "${db}_copy", q{'done', request => '{"k": "done"}'}),
		replay_row('succeeded', 201, $md5{done}), "${db}_copy: done replays its stored response");
	sql('postgres', "DROP DATABASE ${db}_copy");

	# --- the catalog -----------------------------------------------------------
	sql($db, 'REVOKE USAGE ON SCHEMA idempotency FROM regress_up_tenant');
	foreach my $what (sort keys %catalog)
	{
		is(sql($db, $catalog{$what}), $fresh{$what}, "$db updated = fresh: $what");
	}
	is(stale_initacl_deps($node, $db), '',
		"$db: no role dependency of initial privileges outlives them");
}

my ($state, $out, $err) = sql_result($node, 'postgres', 'DROP ROLE regress_up_tenant');
is($state, '00000', 'with its grants revoked and bindings deleted, the role can be dropped')
  or diag($err);

# =========================================================================
# Privileges an administrator set before the update carry over
# =========================================================================
# regress_lead, regress_worker, "Regress App": EXECUTE on idem_claim
# (grant_claim_per_role), "Regress App" also on idem_lookup;
# regress_monitor: stats_counters and the stats view; regress_binder:
# unbind_scope and what its DELETE needs (it runs as its caller);
# regress_plain: USAGE on the schema and nothing else.
my $roles = 'regress_lead, regress_worker, "Regress App", regress_monitor, regress_binder, '
  . 'regress_plain';
sql('postgres', join('', map { "CREATE ROLE $_; " } split /, /, $roles)
	  . 'CREATE ROLE regress_admin SUPERUSER LOGIN');
my @granted_fns = qw(idem_claim idem_lookup stats_counters unbind_scope);
my $granted_list = join(', ', map { "'$_'" } @granted_fns);

# "name owner acl" of the functions and relations the grants are on, with
# the relations' options when $options.
sub acls
{
	my ($db, $options) = @_;
	my $opt = $options ? ', c.reloptions' : '';
	return sql($db,
		    "SELECT string_agg(concat_ws(' ', p.proname, p.proowner::regrole, p.proacl), E'\\n' "
		  . "ORDER BY p.proname) || E'\\n' || (SELECT string_agg(concat_ws(' ', c.relname, "
		  . "c.relowner::regrole, c.relacl$opt), E'\\n' ORDER BY c.relname) FROM pg_class c "
		  . "WHERE c.oid IN ('idempotency.stats'::regclass, 'idempotency.scope_bindings'::regclass)) "
		  . "FROM pg_proc p WHERE p.pronamespace = 'idempotency'::regnamespace "
		  . "AND p.proname IN ($granted_list)");
}

# Who may execute the functions in the SQL list $fns: "function:role=bool,...".
sub may_execute
{
	my ($db, $fns) = @_;
	return sql($db,
		    "SELECT string_agg(p.proname || ':' || r || '=' || has_function_privilege(r, p.oid, "
		  . "'EXECUTE'), ',' ORDER BY p.proname, r) FROM pg_proc p, unnest(ARRAY['public', "
		  . "'regress_lead', 'regress_worker', 'Regress App', 'regress_monitor', 'regress_binder', "
		  . "'regress_plain']) AS r WHERE p.pronamespace = 'idempotency'::regnamespace "
		  . "AND p.proname IN ($fns)");
}
my $init_privs_sql =
    "SELECT count(*) FROM pg_init_privs i JOIN pg_proc p ON p.oid = i.objoid "
  . "WHERE i.classoid = 'pg_proc'::regclass AND p.pronamespace = 'idempotency'::regnamespace "
  . "AND p.proname IN ($granted_list)";
my $fresh_init_privs = sql('fresh', $init_privs_sql);

foreach my $rel (@released)
{
	my $from = $rel->{version};
	(my $db = "acl_$from") =~ s/\./_/;
	sql('postgres', "CREATE DATABASE $db");
	sql($db, "CREATE EXTENSION idempotency VERSION '$from'");
	grant_claim_per_role($node, $db);
	sql($db, q{
GRANT USAGE ON SCHEMA idempotency TO regress_monitor, regress_binder, regress_plain;
REVOKE EXECUTE ON FUNCTION idempotency.idem_lookup FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency.idem_lookup TO "Regress App";
REVOKE EXECUTE ON FUNCTION idempotency.stats_counters FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency.stats_counters TO regress_monitor;
REVOKE SELECT ON idempotency.stats FROM PUBLIC;
GRANT SELECT ON idempotency.stats TO regress_monitor;
ALTER VIEW idempotency.stats SET (security_barrier = true);
GRANT EXECUTE ON FUNCTION idempotency.unbind_scope TO regress_binder;
GRANT SELECT, DELETE ON idempotency.scope_bindings TO regress_binder;
SELECT idempotency.bind_scope('regress_plain', 'plain:');
});
	finish_key($node, $db, 'done', '1 hour', undef);
	my $acls = acls($db, 1);
	like($acls, qr/^idem_claim postgres \{.*regress_worker=X\/regress_lead/m,
		"$db: under $from, regress_lead granted EXECUTE on idem_claim to regress_worker");
	my $may = may_execute($db, $granted_list);

	is(sqlstate_of($node, $db, 'ALTER EXTENSION idempotency UPDATE'), '00000',
		"$db: ALTER EXTENSION idempotency UPDATE from $from succeeds");
	is(ext_version($db), $current, "$db: updated to $current");
	is(acls($db, 1), $acls,
		"$db: the functions and relations keep their owners, privileges, grantors and options");
	is(may_execute($db, $granted_list), $may, "$db: the same roles may execute them");
	like($may, qr/idem_claim:public=false.*idem_claim:regress_worker=true/,
		"$db: PUBLIC may not execute idem_claim, regress_worker may");
	unlike(may_execute($db, "'distribute'"), qr/=true/,
		"$db: none of them, nor PUBLIC, may execute distribute()");
	is(sql($db, $init_privs_sql), $fresh_init_privs,
		"$db: the grants are not recorded as the extension's initial privileges");
	is(stale_initacl_deps($node, $db), '',
		"$db: no role dependency of initial privileges outlives them");

	is(sql($db, "SET ROLE regress_worker; SELECT outcome FROM idempotency.idem_claim('w')"),
		'claimed', "$db: regress_worker claims a key");
	is(sqlstate_of($node, $db, "SET ROLE regress_plain; SELECT * FROM idempotency.idem_claim('p')"),
		'42501', "$db: a role without the grant may not");
	is(sql($db, "SET ROLE \"Regress App\"; SELECT status FROM idempotency.idem_lookup('done')"),
		'succeeded', "$db: \"Regress App\" looks a key up");
	is( sqlstate_of($node, $db,
			"SET ROLE regress_plain; SELECT * FROM idempotency.idem_lookup('done')"),
		'42501', "$db: a role without the grant may not");
	is( sql($db, "SET ROLE regress_monitor; SELECT concat_ws(',', pending, succeeded, failed) "
			  . 'FROM idempotency.stats WHERE database = current_database()'),
		'1,1,0', "$db: regress_monitor reads the stats view");
	is( sql($db, "SET ROLE regress_monitor; SELECT concat_ws(',', pending, succeeded, failed) "
			  . 'FROM idempotency.stats_key_counts()'),
		'1,1,0', "$db: and may call stats_key_counts()");
	is(sqlstate_of($node, $db, 'SET ROLE regress_plain; SELECT * FROM idempotency.stats'),
		'42501', "$db: a role kept from the view may not read it");
	is( sqlstate_of($node, $db,
			'SET ROLE regress_plain; SELECT * FROM idempotency.stats_key_counts()'),
		'42501', "$db: nor the counts through stats_key_counts()");
	is(sql($db, "SET ROLE regress_binder; SELECT idempotency.unbind_scope('regress_plain')"),
		't', "$db: regress_binder unbinds a role bound under $from: true");
	is(sql($db, "SET ROLE regress_binder; SELECT idempotency.unbind_scope('regress_plain')"),
		'f', "$db: a second time: false");

	# Everything but these privileges is a fresh install's.
	foreach my $what ('claim_result columns', 'types (owner, privileges)', 'indexes',
		'constraints', 'triggers', 'the stats view', 'the token sequence',
		'extension members', 'extension configuration', 'initial privileges',
		'function definitions', 'view definitions')
	{
		my $q = $what eq 'function definitions' ? $function_defs_sql : $catalog{$what};
		is(sql($db, $q), $fresh{$what}, "$db updated = fresh: $what");
	}

	# A dump of the updated database carries the privileges.
	$node->command_ok(
		[ 'pg_dump', '-Fp', '-d', $node->connstr($db), '-f', "$dumps/$db.sql" ],
		"$db: pg_dump");
	sql('postgres', "CREATE DATABASE ${db}_copy");
	$node->command_ok(
		[
			'psql', '-X', '-q', '-v', 'ON_ERROR_STOP=1', '-d', $node->connstr("${db}_copy"),
			'-f', "$dumps/$db.sql"
		],
		"$db: the dump is restored into a fresh database");
	# (pg_dump dumps no option set on an extension's view.)
	is(acls("${db}_copy", 0), acls($db, 0), "${db}_copy: the dump carried the privileges");
	sql('postgres', "DROP DATABASE ${db}_copy");

	revoke_claim_per_role($node, $db);
	sql($db, q{
REVOKE EXECUTE ON FUNCTION idempotency.idem_lookup FROM "Regress App";
REVOKE EXECUTE ON FUNCTION idempotency.stats_counters FROM regress_monitor;
REVOKE SELECT ON idempotency.stats FROM regress_monitor;
REVOKE EXECUTE ON FUNCTION idempotency.unbind_scope FROM regress_binder;
REVOKE SELECT, DELETE ON idempotency.scope_bindings FROM regress_binder;
REVOKE USAGE ON SCHEMA idempotency FROM regress_monitor, regress_binder, regress_plain;
});
}
($state, $out, $err) = sql_result($node, 'postgres', "DROP ROLE $roles");
is($state, '00000', 'with their grants revoked, the granted roles can be dropped')
  or diag($err);

# Another superuser than the one who installed 1.0 updates it: idem_claim,
# which the update creates anew, and its new row type keep 1.0's owner.
sql('postgres', 'CREATE DATABASE owner_1_0');
sql('owner_1_0', "CREATE EXTENSION idempotency VERSION '1.0'");
is( $node->safe_psql('owner_1_0',
		    'ALTER EXTENSION idempotency UPDATE; '
		  . "SELECT current_setting('role') || ',' || current_user",
		extra_params => [ '-U', 'regress_admin' ]),
	'none,regress_admin', 'owner_1_0: regress_admin updates, the session\'s role left alone');
is( sql('owner_1_0',
		    "SELECT proowner::regrole || ',' || (SELECT typowner::regrole FROM pg_type "
		  . "WHERE oid = 'idempotency.claim_result'::regtype) "
		  . "FROM pg_proc WHERE oid = '$CLAIM_FN'::regproc"),
	'postgres,postgres', 'owner_1_0: idem_claim and claim_result keep 1.0\'s owner');
sql('postgres', 'DROP DATABASE owner_1_0; DROP ROLE regress_admin');

# =========================================================================
# A user's objects on idem_claim and on the stats view
# =========================================================================
my $claim_view = 'CREATE VIEW public.claim_view AS SELECT outcome, response_code '
  . "FROM idempotency.idem_claim('dep-1')";
my $claim_fn = 'CREATE FUNCTION public.claim_outcome(k text) RETURNS text LANGUAGE sql '
  . 'BEGIN ATOMIC SELECT outcome FROM idempotency.idem_claim(k); END';
my $counts_view = 'CREATE VIEW public.key_counts AS SELECT pending, succeeded, failed '
  . 'FROM idempotency.stats WHERE database = current_database()';

# The user's three objects answer in $db.
sub user_objects_work
{
	my ($db, $what) = @_;
	is(sql($db, 'SELECT outcome, response_code FROM public.claim_view'), 'replay|200',
		"$db: $what: the view on idem_claim replays");
	is(sql($db, "SELECT public.claim_outcome('dep-1')"), 'replay',
		"$db: $what: so does the BEGIN ATOMIC function");
	like(sql($db, "SELECT concat_ws(',', pending, succeeded, failed) FROM public.key_counts"),
		qr/^\d+,\d+,0$/, "$db: $what: the view on the stats view counts");
	return;
}

foreach my $rel (@released)
{
	my $from = $rel->{version};
	(my $db = "dep_$from") =~ s/\./_/;
	sql('postgres', "CREATE DATABASE $db");
	sql($db, "CREATE EXTENSION idempotency VERSION '$from'");
	finish_key($node, $db, 'dep-1', '1 hour', q{'{"v": 1}'});
	my $pending = claim($node, $db, "'dep-pending', lease => '1 hour'");
	sql($db, "$claim_view; $claim_fn; $counts_view");
	user_objects_work($db, "under $from");

	if (!$rel->{claim_recreated})
	{
		is(sqlstate_of($node, $db, 'ALTER EXTENSION idempotency UPDATE'), '00000',
			"$db: the update from $from goes through with them in place");
		user_objects_work($db, 'after the update');
		next;
	}

	my $rows = key_rows($node, $db);
	my $seq  = sql($db, $seq_sql);
	# Every catalog query's SQLSTATE and answer (1.0 has no claim_result).
	my $catalog_now = sub {
		return join("\n",
			map { join(' ', $_, sql_result($node, $db, $catalog{$_})) } sort keys %catalog);
	};
	my $catalog_before = $catalog_now->();
	($state, $out, $err) = sql_result($node, $db, 'ALTER EXTENSION idempotency UPDATE');
	is($state, '2BP01', "$db: an object on idem_claim makes the update from $from fail (2BP01)");
	like($err,
		qr/(view public\.claim_view|function public\.claim_outcome\(text\)) depends on function idem_claim/,
		"$db: the error names it");
	is(ext_version($db), $from, "$db: the extension is still $from");
	is(key_rows($node, $db), $rows, "$db: the stored rows are unchanged");
	is(sql($db, $seq_sql), $seq, "$db: the token sequence did not move");
	is($catalog_now->(), $catalog_before, "$db: the catalog is unchanged");
	user_objects_work($db, "still $from");
	is( sqlstate_of($node, $db,
			"SELECT idempotency.idem_finish('dep-pending', $pending->{token}, 204)"),
		'00000', "$db: $from still finishes a pending key");
	is(sql($db, "SELECT status FROM idempotency.idem_lookup('dep-pending')"), 'succeeded',
		"$db: and looks it up");

	# What docs/upgrading.md says to do: drop, update, create again.
	sql($db, 'DROP VIEW public.claim_view; DROP FUNCTION public.claim_outcome(text)');
	is(sqlstate_of($node, $db, 'ALTER EXTENSION idempotency UPDATE'), '00000',
		"$db: without them the update succeeds");
	sql($db, "$claim_view; $claim_fn");
	user_objects_work($db, 'created again');
}

# =========================================================================
# PostgreSQL 17+: the update repairs what the first 1.0 to 1.1 script left
# =========================================================================
SKIP:
{
	my $version_num = sql('postgres', 'SHOW server_version_num');
	skip 'PostgreSQL before 17 records no role dependencies of initial privileges '
	  . "(pg_shdepend deptype 'i'): nothing to repair on $version_num", 9
	  if $version_num < 170000;

	my $granted = 'regress_lead, regress_worker, "Regress App"';
	# A 1.0 database with the administrator's grants, updated to 1.1.  The
	# update's grants record initial privileges and, with them, a role
	# dependency on each role they name; an event trigger keeps a copy of
	# those rows as each grant left them, before the script removes them.
	sql('postgres', 'CREATE DATABASE stale');
	sql('stale', "CREATE EXTENSION idempotency VERSION '1.0'");
	sql('postgres', join('', map { "CREATE ROLE $_; " } split /, /, $granted));
	grant_claim_per_role($node, 'stale');
	sql('stale', q{
CREATE TABLE public.initacl_deps AS SELECT * FROM pg_shdepend WHERE false;
CREATE FUNCTION public.keep_initacl_deps() RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
	INSERT INTO public.initacl_deps
	SELECT * FROM pg_shdepend
	 WHERE deptype = 'i' AND classid = 'pg_proc'::regclass
	   AND dbid = (SELECT oid FROM pg_database WHERE datname = current_database());
END
$$;
CREATE EVENT TRIGGER keep_initacl_deps ON ddl_command_end WHEN TAG IN ('GRANT')
	EXECUTE FUNCTION public.keep_initacl_deps();
});
	is(sqlstate_of($node, 'stale', "ALTER EXTENSION idempotency UPDATE TO '1.1'"),
		'00000', 'stale: updated to 1.1');
	sql('stale', 'DROP EVENT TRIGGER keep_initacl_deps');
	is(stale_initacl_deps($node, 'stale'), '',
		'stale: the 1.0 to 1.1 update leaves no role dependency of initial privileges');
	is( sql('stale',
			    "SELECT string_agg(DISTINCT refobjid::regrole::text, ', ') "
			  . "FROM public.initacl_deps WHERE objid = '$CLAIM_FN'::regproc"),
		'"Regress App", regress_lead, regress_worker',
		'stale: its grants recorded a role dependency on each granted role');

	# What the first release of the script left behind.
	sql('stale',
		'INSERT INTO pg_shdepend SELECT DISTINCT * FROM public.initacl_deps; '
		  . 'DROP TABLE public.initacl_deps; DROP FUNCTION public.keep_initacl_deps()');
	like(
		stale_initacl_deps($node, 'stale'),
		qr/\A(function idempotency\.idem_claim\(.*\) -> .+\n?){3}\z/,
		'stale: three role dependencies of idem_claim without initial privileges');
	revoke_claim_per_role($node, 'stale');
	($state, $out, $err) = sql_result($node, 'stale', "DROP ROLE $granted");
	is($state, '2BP01', 'stale: they keep DROP ROLE failing after the grants are revoked');
	like($err, qr/initial privileges for function idempotency\.idem_claim/,
		'stale: the error names idem_claim\'s initial privileges');

	is(sqlstate_of($node, 'stale', 'ALTER EXTENSION idempotency UPDATE'),
		'00000', "stale: updated to $current");
	is(stale_initacl_deps($node, 'stale'), '',
		'stale: the update removed the role dependencies without initial privileges');
	($state, $out, $err) = sql_result($node, 'stale', "DROP ROLE $granted");
	is($state, '00000', 'stale: now the roles can be dropped') or diag($err);
}

$node->stop;
done_testing();
