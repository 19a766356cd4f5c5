
# Copyright: the idempotency extension authors.
#
# 209_upgrade_1_4.pl: ALTER EXTENSION idempotency UPDATE to 1.4, from each
# released version (1.0, 1.1, 1.2, 1.3).
#
# What it proves, for each of them:
#   - before the update, the installed 1.4 library serves the old version's
#     database: claim, finish, lookup and the stats view work as they did,
#     and a checkpoint (through the C function declared by hand) is refused
#     with 55000 rather than written nowhere;
#   - a database with finished keys (with response bodies), pending keys
#     under a live lease and a pending key whose lease ended updates without
#     touching a stored row (same ctid and xmin, every column identical, the
#     new columns NULL) or the token sequence;
#   - after the update the finished keys replay their stored responses, the
#     owner of a pending key checkpoints and finishes it with the token it
#     got before the update, the key whose lease ended is taken over as
#     attempt 2 and resumes from a checkpoint after a second takeover, and
#     idem_claim_many, idem_finish_many, idem_checkpoint and session-bound
#     claims work;
#   - privileges an administrator set on the three functions the update
#     replaces (idem_claim, idem_lookup, stats_counters: EXECUTE revoked
#     from PUBLIC, granted per role, one grant made by a role holding the
#     grant option) are the same after it, the granted roles can still call
#     them and PUBLIC still cannot; they are not recorded as the
#     extension's initial privileges (a fresh install has none for these
#     functions either), and once revoked the roles can be dropped;
#   - the stats view gains checkpoints as its last column, keeps the other
#     columns in order, its privileges and the option the administrator
#     set, and counts the checkpoints;
#   - the updated catalog is a fresh 1.4 install's: with the administrator's
#     privileges, every definition (functions, claim_result, indexes,
#     constraints, triggers, the stats view, the sequence, the member
#     list); without them, everything catalog_queries compares, privileges
#     and initial privileges included.
# And: a user view that depends on idem_claim makes the update fail with
# 2BP01 and leaves the 1.3 database as it was.
#
# Run it like the other TAP tests (see the top of t/001_restart.pl).  Port
# 55474 only names the socket file.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

# No sweeps: the key whose lease ended stays pending until the test takes it
# over, and no finished key's sweep_at moves.
my $node = new_node('upgrade_1_4', port => 55474,
	init => [ extra => [ '--encoding=UTF8', '--locale=C' ] ],
	conf => ['idempotency.sweep_interval = 0']);

sub sql { my ($db, $sql) = @_; return $node->safe_psql($db, $sql); }

my @from = ('1.0', '1.1', '1.2', '1.3');

# The functions the update replaces: their signature before and after.
my $claim_old  = $CLAIM_SIG;
my $claim_new  = 'idempotency.idem_claim(text,jsonb,text,interval,interval,interval,boolean)';
my $lookup_sig = 'idempotency.idem_lookup(text,text)';
my $counters_sig = 'idempotency.stats_counters()';

my $granted_roles = 'regress_lead, regress_worker, "Regress App", regress_monitor, regress_other';
sql('postgres', "CREATE ROLE regress_lead; CREATE ROLE regress_worker; "
	  . 'CREATE ROLE "Regress App"; CREATE ROLE regress_monitor; CREATE ROLE regress_other');

sub ext_version
{
	my ($db) = @_;
	return sql($db, "SELECT extversion FROM pg_extension WHERE extname = 'idempotency'");
}

# "acl of idem_claim | acl of idem_lookup | acl of stats_counters", the
# signature of idem_claim being $claim_sig.
sub function_acls
{
	my ($db, $claim_sig) = @_;
	return sql($db,
		    "SELECT concat_ws(' | ', (SELECT proacl FROM pg_proc WHERE oid = '$claim_sig'::regprocedure), "
		  . "(SELECT proacl FROM pg_proc WHERE oid = '$lookup_sig'::regprocedure), "
		  . "(SELECT proacl FROM pg_proc WHERE oid = '$counters_sig'::regprocedure))");
}

# Who may execute the three functions: "role=bool,..." for each.
sub may_execute
{
	my ($db, $claim_sig) = @_;
	return sql($db,
		    "SELECT string_agg(f || ':' || r || '=' || has_function_privilege(r, s, 'EXECUTE'), ',' "
		  . "ORDER BY f, r) FROM (VALUES ('claim', '$claim_sig'), ('lookup', '$lookup_sig'), "
		  . "('counters', '$counters_sig')) AS fn(f, s), "
		  . "unnest(ARRAY['public', 'regress_lead', 'regress_worker', 'Regress App', "
		  . "'regress_monitor', 'regress_other']) AS r");
}

my $view_columns_sql =
    "SELECT string_agg(attname || ' ' || format_type(atttypid, atttypmod), ', ' "
  . "ORDER BY attnum) FROM pg_attribute "
  . "WHERE attrelid = 'idempotency.stats'::regclass AND attnum > 0";
my $view_acl_sql =
  "SELECT concat_ws(' ', relacl, reloptions) FROM pg_class WHERE oid = 'idempotency.stats'::regclass";
my $key_counts_sql =
    "SELECT concat_ws(',', pending, succeeded, failed) FROM idempotency.stats "
  . "WHERE database = current_database()";
my $seq_sql = 'SELECT last_value FROM idempotency.token_seq';

# The definitions of the extension's functions, without owner or privileges.
my $function_defs_sql =
    "SELECT string_agg(pg_get_functiondef(p.oid), E'\\n' ORDER BY p.oid::regprocedure::text) "
  . "FROM pg_proc p JOIN pg_depend d ON d.classid = 'pg_proc'::regclass AND d.objid = p.oid "
  . "WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e' "
  . "AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency')";

my $done_body   = q{'{"id": 1, "items": ["a", "b"]}'};
my $failed_body = q{'{"error": "card declined"}'};
my %md5;
$md5{done}   = body_md5($node, 'postgres', $done_body);
$md5{failed} = body_md5($node, 'postgres', $failed_body);

# =========================================================================
# A fresh 1.4 install, to compare with
# =========================================================================
sql('postgres', 'CREATE DATABASE fresh');
sql('fresh', "CREATE EXTENSION idempotency VERSION '1.4'");
is(ext_version('fresh'), '1.4', 'fresh: 1.4 is installed');
my $fresh_columns = sql('fresh', $view_columns_sql);
like($fresh_columns, qr/, key_counts_exact boolean, checkpoints bigint$/,
	'fresh: the stats view ends with key_counts_exact and checkpoints');
my $fresh_init_privs = sql('fresh',
	    "SELECT count(*) FROM pg_init_privs WHERE objoid IN ('$claim_new'::regprocedure, "
	  . "'$lookup_sig'::regprocedure, '$counters_sig'::regprocedure)");
is($fresh_init_privs, '0', 'fresh: no initial privileges for idem_claim, idem_lookup, stats_counters');
my %catalog = catalog_queries();
my %fresh;
$fresh{$_} = sql('fresh', $catalog{$_}) foreach keys %catalog;
$fresh{'function definitions'} = sql('fresh', $function_defs_sql);
isnt($fresh{$_}, '', "fresh: $_: the query finds something") foreach sort keys %fresh;

# =========================================================================
# Each released version: fill, grant, update, check
# =========================================================================
foreach my $from (@from)
{
	(my $db = "up_$from") =~ s/\./_/;
	sql('postgres', "CREATE DATABASE $db");
	sql($db, "CREATE EXTENSION idempotency VERSION '$from'");
	is(ext_version($db), $from, "$db: $from is installed");

	# --- keys, under the old version and the 1.4 library ------------------
	my %tok;
	foreach my $key (qw(done failed live short))
	{
		my $lease = $key eq 'short' ? '1 second' : '1 hour';
		my $c = claim($node, $db, qq{'$key', request => '{"k": "$key"}', lease => '$lease'});
		is($c->{outcome} . ',' . $c->{attempt}, 'claimed,1', "$db: $key is claimed under $from");
		$tok{$key} = $c->{token};
	}
	sql($db, "SELECT idempotency.idem_finish('done', $tok{done}, 201, $done_body)");
	sql($db, "SELECT idempotency.idem_finish('failed', $tok{failed}, 402, $failed_body, "
		  . "status => 'failed')");
	is( sql($db, "SELECT concat_ws(',', status, attempt, response_code, md5(response_body::text)) "
			  . "FROM idempotency.idem_lookup('done')"),
		"succeeded,1,201,$md5{done}", "$db: lookup under $from");
	is_deeply(claim($node, $db, q{'done', request => '{"k": "done"}'}),
		replay_row('succeeded', 201, $md5{done}), "$db: done replays under $from");
	is(sql($db, $key_counts_sql), '2,1,1', "$db: the stats view counts under $from");
	is( sql($db, "SELECT claims = 4 AND replays = 1 AND finishes = 2 FROM idempotency.stats "
			  . "WHERE database = current_database()"),
		't', "$db: the stats view's counters under $from");
	# A checkpoint has nowhere to go in a table of the old version: the C
	# function, declared by hand, refuses it (55000) and changes nothing.
	sql($db, "CREATE FUNCTION public.checkpoint_by_hand(text, bigint, text, jsonb, text) "
		  . "RETURNS void AS '\$libdir/idempotency', 'idem_checkpoint' LANGUAGE C");
	my $rows_before_ckpt = key_rows($node, $db);
	is( sqlstate_of($node, $db,
			"SELECT public.checkpoint_by_hand('live', $tok{live}, 'step', NULL, '')"),
		'55000', "$db: a checkpoint under $from is refused");
	is(key_rows($node, $db), $rows_before_ckpt, "$db: and changes no key");
	sql($db, 'DROP FUNCTION public.checkpoint_by_hand(text, bigint, text, jsonb, text)');

	# --- the administrator's privileges and the view's option -------------
	grant_claim_per_role($node, $db);
	sql($db, qq{
GRANT USAGE ON SCHEMA idempotency TO regress_monitor, regress_other;
REVOKE EXECUTE ON FUNCTION $lookup_sig FROM PUBLIC;
GRANT EXECUTE ON FUNCTION $lookup_sig TO "Regress App";
REVOKE EXECUTE ON FUNCTION $counters_sig FROM PUBLIC;
GRANT EXECUTE ON FUNCTION $counters_sig TO regress_monitor;
REVOKE SELECT ON idempotency.stats FROM PUBLIC;
GRANT SELECT ON idempotency.stats TO regress_monitor;
ALTER VIEW idempotency.stats SET (security_barrier = true);
});
	my $acls = function_acls($db, $claim_old);
	like($acls, qr/regress_worker=X\/regress_lead/,
		"$db: regress_lead granted EXECUTE on idem_claim to regress_worker");
	my $may = may_execute($db, $claim_old);
	my $view_acl = sql($db, $view_acl_sql);
	like($view_acl, qr/regress_monitor=r\/postgres.* \{security_barrier=true\}$/,
		"$db: the view's privileges and option are set");
	my $columns_before = sql($db, $view_columns_sql);

	ok(wait_lease_over($node, $db, '', 'short'), "$db: the lease of short has ended");
	my $rows = key_rows($node, $db);
	my $seq  = sql($db, $seq_sql);

	# --- the update --------------------------------------------------------
	is(sqlstate_of($node, $db, "ALTER EXTENSION idempotency UPDATE TO '1.4'"), '00000',
		"$db: ALTER EXTENSION idempotency UPDATE TO '1.4' succeeds");
	is(ext_version($db), '1.4', "$db: updated to 1.4");
	is(key_rows($node, $db), $rows,
		"$db: every stored row is the same tuple (ctid, xmin), column for column");
	is( sql($db, 'SELECT count(*) FROM idempotency.keys WHERE phase IS NOT NULL '
			  . 'OR phase_data IS NOT NULL OR owner_session IS NOT NULL'),
		'0', "$db: the new columns are NULL in every row");
	is(sql($db, $seq_sql), $seq, "$db: the token sequence did not move");

	# --- privileges --------------------------------------------------------
	is(function_acls($db, $claim_new), $acls,
		"$db: idem_claim, idem_lookup, stats_counters keep their privileges, grantors and order");
	is(may_execute($db, $claim_new), $may, "$db: the same roles may execute them");
	like($may, qr/claim:public=false.*claim:regress_worker=true/,
		"$db: PUBLIC may not execute idem_claim, regress_worker may");
	is( sql($db, "SET ROLE regress_worker; SELECT outcome FROM idempotency.idem_claim('w', "
			  . "session_bound => false)"),
		'claimed', "$db: regress_worker claims a key through the new idem_claim");
	is( sqlstate_of($node, $db,
			"SET ROLE regress_other; SELECT * FROM idempotency.idem_claim('o')"),
		'42501', "$db: a role without the grant (with USAGE on the schema) may not");
	is( sql($db, "SET ROLE \"Regress App\"; SELECT status FROM idempotency.idem_lookup('done')"),
		'succeeded', "$db: \"Regress App\" looks a key up");
	is( sqlstate_of($node, $db,
			"SET ROLE regress_other; SELECT * FROM idempotency.idem_lookup('done')"),
		'42501', "$db: a role without the grant may not look up");
	is( sql($db,
			    "SELECT count(*) FROM pg_init_privs WHERE objoid IN ('$claim_new'::regprocedure, "
			  . "'$lookup_sig'::regprocedure, '$counters_sig'::regprocedure)"),
		$fresh_init_privs, "$db: no initial privileges for the replaced functions, as fresh");
	is(stale_initacl_deps($node, $db), '',
		"$db: no role dependency of initial privileges outlives them");

	# --- the stats view ----------------------------------------------------
	is(sql($db, $view_columns_sql), $fresh_columns, "$db: the stats view has fresh 1.4's columns");
	like($fresh_columns, qr/^\Q$columns_before\E, /,
		"$db: its columns of before come first, in order");
	is(sql($db, $view_acl_sql), $view_acl, "$db: the view keeps its privileges and option");
	is( sql($db, "SET ROLE regress_monitor; SELECT concat_ws(',', pending, succeeded, failed, "
			  . "checkpoints) FROM idempotency.stats WHERE database = current_database()"),
		'3,1,1,0', "$db: regress_monitor reads the counts and checkpoints");
	is( sql($db, "SELECT has_table_privilege('public', 'idempotency.stats', 'SELECT')"),
		'f', "$db: PUBLIC still may not read the view");
	is( sqlstate_of($node, $db,
			"SET ROLE regress_other; SELECT * FROM idempotency.stats"),
		'42501', "$db: a role without the grant (with USAGE on the schema) may not");

	# --- the old keys ------------------------------------------------------
	is_deeply(claim($node, $db, q{'done', request => '{"k": "done"}'}),
		replay_row('succeeded', 201, $md5{done}), "$db: done replays its stored response");
	is_deeply(claim($node, $db, q{'failed', request => '{"k": "failed"}'}),
		replay_row('failed', 402, $md5{failed}), "$db: failed replays its stored failure");
	is_deeply(claim($node, $db, q{'done', request => '{"k": "other"}'}), mismatch_row(),
		"$db: done with another request is a mismatch");

	my $c = claim($node, $db, q{'live', request => '{"k": "live"}'});
	is($c->{outcome}, 'in_progress', "$db: live is in progress under its old lease");
	is( sqlstate_of($node, $db,
			"SELECT idempotency.idem_checkpoint('live', $tok{live}, 'half', '{\"n\": 1}')"),
		'00000', "$db: the owner of live checkpoints with its old token");
	is( sqlstate_of($node, $db,
			"SELECT idempotency.idem_finish('live', $tok{live}, 200, '{\"done\": true}')"),
		'00000', "$db: and finishes with it");
	is(sql($db, "SELECT concat_ws(',', status, attempt, response_code, phase) "
			  . "FROM idempotency.idem_lookup('live')"),
		'succeeded,1,200,half', "$db: live succeeded at attempt 1, its last phase kept");

	# The key whose lease ended: taken over, checkpointed, taken over again.
	$c = claim($node, $db, q{'short', request => '{"k": "short"}', lease => '1 second'});
	is($c->{outcome} . ',' . $c->{attempt}, 'claimed,2', "$db: short is taken over as attempt 2");
	cmp_ok($c->{token}, '>', $tok{short}, "$db: with a larger token");
	my $row = stored_row($node, $db, '', 'short');
	is( sqlstate_of($node, $db, "SELECT idempotency.idem_checkpoint('short', $tok{short}, 'x')"),
		'55006', "$db: the old token of short may not checkpoint (55006)");
	is(stored_row($node, $db, '', 'short'), $row, "$db: which changed nothing");
	sql($db, "SELECT idempotency.idem_checkpoint('short', $c->{token}, 'charged', '{\"charge\": \"ch_9\"}')");
	ok(wait_lease_over($node, $db, '', 'short'), "$db: the lease of the takeover has ended");
	is( sql($db,
			    "SELECT concat_ws(',', outcome, attempt, phase, phase_data->>'charge', "
			  . "idempotency.idem_finish('short', token, 200) IS NOT NULL) "
			  . "FROM idempotency.idem_claim('short', request => '{\"k\": \"short\"}')"),
		'claimed,3,charged,ch_9,t',
		"$db: attempt 3 resumes from attempt 2's checkpoint and finishes");
	is(sql($db, "SELECT concat_ws(',', status, attempt, phase) FROM idempotency.idem_lookup('short')"),
		'succeeded,3,charged', "$db: short succeeded at attempt 3");

	# --- what 1.4 adds -----------------------------------------------------
	is( sql($db,
			    "SELECT string_agg(format('%s:%s:%s:%s:%s', ord, key, outcome, attempt, response_code), ' ' "
			  . "ORDER BY ord) FROM idempotency.idem_claim_many("
			  . "ARRAY['b1', 'done', 'b2', 'b1'], "
			  . "ARRAY['{\"k\": 1}', '{\"k\": \"done\"}', NULL, '{\"k\": 1}']::jsonb[])"),
		'1:b1:claimed:1: 2:done:replay::201 3:b2:claimed:1: 4:b1:in_progress::',
		"$db: idem_claim_many answers each element");
	is( sql($db,
			    "SELECT string_agg(ord || ':' || f.key, ' ' ORDER BY ord) "
			  . "FROM idempotency.idem_finish_many(ARRAY['b1', 'b2'], "
			  . "ARRAY(SELECT token FROM idempotency.keys WHERE key IN ('b1', 'b2') ORDER BY key), "
			  . "ARRAY[200, 204]) AS f"),
		'1:b1 2:b2', "$db: idem_finish_many finishes both");
	is(sql($db, "SELECT string_agg(key || ':' || status || ':' || response_code, ' ' ORDER BY key) "
			  . "FROM idempotency.keys WHERE key IN ('b1', 'b2')"),
		'b1:succeeded:200 b2:succeeded:204', "$db: both are stored finished");

	# A session-bound claim: its psql ends right after, and the next claim
	# takes over once the session's binding lock has gone.
	$c = claim($node, $db, "'bound', lease => '1 hour', session_bound => true");
	is($c->{outcome}, 'claimed', "$db: a session-bound claim");
	ok( $node->poll_query_until($db,
			    "SELECT NOT EXISTS (SELECT FROM pg_locks WHERE locktype = 'advisory' "
			  . "AND objsubid = 7656 AND database = (SELECT oid FROM pg_database "
			  . "WHERE datname = current_database()))"),
		"$db: its session has ended");
	my $c2 = claim($node, $db, "'bound', lease => '1 hour'");
	is($c2->{outcome} . ',' . $c2->{attempt}, 'claimed,2',
		"$db: the next claim takes it over at once");
	is( sql($db, "SELECT checkpoints FROM idempotency.stats WHERE database = current_database()"),
		'2', "$db: the stats view counted the two checkpoints");

	# --- the catalog ---------------------------------------------------------
	foreach my $what ('claim_result columns', 'indexes', 'constraints', 'triggers',
		'the stats view', 'the token sequence', 'extension members',
		'extension configuration', 'function definitions')
	{
		my $q = $what eq 'function definitions' ? $function_defs_sql : $catalog{$what};
		is(sql($db, $q), $fresh{$what}, "$db updated = fresh: $what");
	}

	# --- the roles can go once their grants are revoked ----------------------
	sql($db, qq{
SET ROLE regress_lead;
REVOKE EXECUTE ON FUNCTION $claim_new FROM regress_worker;
RESET ROLE;
REVOKE EXECUTE ON FUNCTION $claim_new FROM regress_lead, "Regress App";
REVOKE EXECUTE ON FUNCTION $lookup_sig FROM "Regress App";
REVOKE EXECUTE ON FUNCTION $counters_sig FROM regress_monitor;
REVOKE SELECT ON idempotency.stats FROM regress_monitor;
REVOKE USAGE ON SCHEMA idempotency FROM regress_lead, regress_worker, "Regress App", regress_monitor,
	regress_other;
});
}
my ($state, $out, $err) = sql_result($node, 'postgres', "DROP ROLE $granted_roles");
is($state, '00000', 'with their grants revoked, the granted roles can be dropped') or diag($err);

# =========================================================================
# Without an administrator's privileges, the whole catalog is fresh 1.4's
# =========================================================================
foreach my $from (@from)
{
	(my $db = "cat_$from") =~ s/\./_/;
	sql('postgres', "CREATE DATABASE $db");
	sql($db, "CREATE EXTENSION idempotency VERSION '$from'");
	is(sqlstate_of($node, $db, "ALTER EXTENSION idempotency UPDATE TO '1.4'"), '00000',
		"$db: updated from $from");
	is(ext_version($db), '1.4', "$db: 1.4");
	foreach my $what (sort keys %catalog)
	{
		is(sql($db, $catalog{$what}), $fresh{$what}, "$db updated = fresh: $what");
	}
}

# =========================================================================
# A user view on idem_claim stops the update
# =========================================================================
sql('postgres', 'CREATE DATABASE dep');
sql('dep', "CREATE EXTENSION idempotency VERSION '1.3'");
finish_key($node, 'dep', 'dep-1', '1 hour', q{'{"v": 1}'});
my $dep_claim = claim($node, 'dep', "'dep-pending', lease => '1 hour'");
sql('dep',
	"CREATE VIEW public.claim_view AS SELECT outcome, response_code "
	  . "FROM idempotency.idem_claim('dep-1')");
my $dep_rows = key_rows($node, 'dep');
my $dep_seq  = sql('dep', $seq_sql);
my %dep_catalog;
$dep_catalog{$_} = sql('dep', $catalog{$_}) foreach keys %catalog;

($state, $out, $err) = sql_result($node, 'dep', "ALTER EXTENSION idempotency UPDATE TO '1.4'");
is($state, '2BP01', 'dep: a view on idem_claim makes the update fail (2BP01)');
like($err, qr/view public\.claim_view depends on function idem_claim/,
	'dep: the error names the view');
is(ext_version('dep'), '1.3', 'dep: the extension is still 1.3');
is(key_rows($node, 'dep'), $dep_rows, 'dep: the stored rows are unchanged');
is(sql('dep', $seq_sql), $dep_seq, 'dep: the token sequence did not move');
foreach my $what (sort keys %catalog)
{
	is(sql('dep', $catalog{$what}), $dep_catalog{$what}, "dep: $what unchanged");
}
is(sql('dep', 'SELECT outcome, response_code FROM public.claim_view'), 'replay|200',
	'dep: the view still replays');
is( sqlstate_of($node, 'dep',
		"SELECT idempotency.idem_finish('dep-pending', $dep_claim->{token}, 204)"),
	'00000', 'dep: 1.3 still finishes a pending key');
is(sql('dep', "SELECT status FROM idempotency.idem_lookup('dep-pending')"), 'succeeded',
	'dep: and looks it up');

sql('dep', 'DROP VIEW public.claim_view');
is(sqlstate_of($node, 'dep', "ALTER EXTENSION idempotency UPDATE TO '1.4'"), '00000',
	'dep: without the view, the update succeeds');
sql('dep',
	"CREATE VIEW public.claim_view AS SELECT outcome, response_code, phase "
	  . "FROM idempotency.idem_claim('dep-1')");
is(sql('dep', 'SELECT outcome, response_code FROM public.claim_view'), 'replay|200',
	'dep: the view, created again, replays on 1.4');

$node->stop;
done_testing();
