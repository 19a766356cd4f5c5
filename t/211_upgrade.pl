
# Copyright: the idempotency extension authors.
#
# 211_upgrade.pl: ALTER EXTENSION idempotency UPDATE from every released
# version to the newest (the control file's default_version), driven by one
# table of the released versions and what each can store.
#
# What it proves, for each released version:
#   - CREATE EXTENSION idempotency VERSION '<v>' installs it;
#   - a database with keys in every state that version can store (finished
#     with a response, failed, pending under a live lease, pending with an
#     expired lease, a bound tenant's pending key, and from 1.4 on a key at a
#     recovery point and keys claimed and finished in batches) updates
#     without touching a stored row (same ctid and xmin, every column), a
#     scope binding, or the token sequence;
#   - after the update: finished keys replay, a different request is a
#     mismatch, the live key is in progress and its owner finishes it with
#     the token from before the update, the stale key is taken over
#     (attempt 2, a larger token) and its old token is dead (55006), a
#     recovery point is still there and is finished with its old token, the
#     tenant is still confined to its prefix;
#   - in a read-only transaction every function that writes, the
#     administrator's included, raises 25006 and changes nothing;
#   - the updated catalog is a fresh install's, definition for definition,
#     owners and privileges included, and no role dependency of initial
#     privileges outlives them.
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

# Every released version, and whether it has recovery points and batches.
my @released = (
	{ version => '1.0', since_1_4 => 0 },
	{ version => '1.1', since_1_4 => 0 },
	{ version => '1.2', since_1_4 => 0 },
	{ version => '1.3', since_1_4 => 0 },
	{ version => '1.4', since_1_4 => 1 },
	{ version => '1.5', since_1_4 => 1 },);

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

my $bindings_sql =
    "SELECT string_agg(concat_ws('|', ctid, xmin, role, scope_prefix), E'\\n' "
  . "ORDER BY role::text) FROM idempotency.scope_bindings";
my $seq_sql = 'SELECT last_value FROM idempotency.token_seq';
my $view_defs_sql =
    "SELECT string_agg(c.oid::regclass || E':\\n' || pg_get_viewdef(c.oid), E'\\n' "
  . "ORDER BY c.oid::regclass::text) FROM pg_class c "
  . "WHERE c.relnamespace = 'idempotency'::regnamespace AND c.relkind = 'v'";

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
	# The stale key's lease has passed once its own lease_until has.
	sql($db, "SELECT pg_sleep_until(lease_until) FROM idempotency.keys "
		  . "WHERE scope = '' AND key = 'stale'");

	my $rows     = key_rows($node, $db);
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

	# --- read-only transactions: every writer refused, nothing changed ------
	foreach my $call (@writers)
	{
		is(sqlstate_of($node, $db, "BEGIN READ ONLY; $call"), '25006',
			"$db: in a read-only transaction: $call raises 25006");
	}
	is(key_rows($node, $db), $rows, "$db: the refused calls changed no key");
	is(sql($db, $bindings_sql), $bindings, "$db: nor a binding");

	# --- the old keys ----------------------------------------------------------
	is_deeply(claim($node, $db, q{'done', request => '{"k": "done"}'}),
		replay_row('succeeded', 201, $md5{done}), "$db: done replays its stored response");
	is_deeply(claim($node, $db, q{'failed', request => '{"k": "failed"}'}),
		replay_row('failed', 402, $md5{failed}), "$db: failed replays its stored failure");
	is_deeply(claim($node, $db, q{'done', request => '{"k": "other"}'}), mismatch_row(),
		"$db: done with another request is a mismatch");
	$c = claim($node, $db, q{'live', request => '{"k": "live"}'});
	is($c->{outcome} . ',' . ($c->{token} // 'NULL'), 'in_progress,NULL',
		"$db: live is in progress under its old lease");
	is(sqlstate_of($node, $db, "SELECT idempotency.idem_finish('live', $tok{live}, 200)"),
		'00000', "$db: the owner of live finishes it with its old token");
	is( sql($db, "SELECT concat_ws(',', status, attempt, token, response_code) "
			  . "FROM idempotency.keys WHERE scope = '' AND key = 'live'"),
		"succeeded,1,$tok{live},200", "$db: live succeeded at attempt 1 with that token");

	$c = claim($node, $db, q{'stale', request => '{"k": "stale"}'});
	is("$c->{outcome},$c->{attempt}", 'claimed,2', "$db: stale is taken over: attempt 2");
	cmp_ok($c->{token}, '>', $seq, "$db: with a token above every token issued before");
	is(sqlstate_of($node, $db, "SELECT idempotency.idem_finish('stale', $tok{stale}, 200)"),
		'55006', "$db: the token from before the takeover is dead (55006)");

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

	is( sqlstate_of($node, $db,
			"SET ROLE regress_up_tenant; SELECT * FROM idempotency.idem_claim('t2', scope => 'other')"),
		'42501', "$db: the tenant bound under $from is still refused another scope");
	is( sqlstate_of($node, $db,
			    "SET ROLE regress_up_tenant; "
			  . "SELECT idempotency.idem_finish('t1', $tok{t1}, 200, NULL, 'tenant:a')"),
		'00000', "$db: and finishes its key with its old token");

	# --- the catalog -----------------------------------------------------------
	sql($db, 'SELECT idempotency.unbind_scope(\'regress_up_tenant\'); '
		  . 'REVOKE USAGE ON SCHEMA idempotency FROM regress_up_tenant');
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

$node->stop;
done_testing();
