
# Copyright: the idempotency extension authors.
#
# 301_citus_outcomes.pl: idempotency keys distributed by scope over a Citus
# cluster (a coordinator and two workers) answer as on a single server.
#
# What it proves:
#   - idempotency.distribute() distributes a table that already holds keys:
#     a key finished before replays after, a key claimed before is still
#     in progress and is finished with the token it got before; the rows
#     live in shards on the workers and every node's own copy of the table
#     stays empty; calling it again changes nothing;
#   - every outcome of claim, finish, extend, release, checkpoint, lookup,
#     the batches, the sweep, a transaction block and bad input (each
#     SQLSTATE) is the same through the coordinator as on a single server:
#     one script (t/citus/scenario.sql) runs on both and the outputs are
#     identical;
#   - claims in 1,000 scopes land on both workers, each claim in the shard
#     of its scope (Citus's own placement of the scope agrees), and each
#     answers in_progress to a second claim;
#   - a call that Citus does not delegate (an expression around the call,
#     or a call on a node that does not hold the scope) is refused with
#     0A000 and writes nothing; a session-bound claim is refused with 0A000,
#     and so is a write while the shards have a trigger (the library writes
#     shards directly only); a call on either worker is served by the one
#     that holds the scope;
#   - scope bindings made on the coordinator confine the bound role on the
#     workers (42501) and unbinding frees it there;
#   - the stats view of each node counts that node's own calls and keys,
#     and idempotency.cluster_stats on the coordinator has one row per node
#     that sum to every claim made.
#
# It skips itself when Citus is not installed for the PostgreSQL under test.
# The nodes listen on 127.0.0.1, ports 31613 to 31615.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemCitus;
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $why = citus_available();
plan skip_all => $why if $why;

my $cluster     = citus_cluster(port => 31613, name => 'outcomes');
my $coordinator = $cluster->{coordinator};
my @workers     = @{ $cluster->{workers} };
my @nodes       = @{ $cluster->{nodes} };

sub coord { return $coordinator->safe_psql('postgres', $_[0]); }

# --- distribute() over existing keys ------------------------------------------

my $t_before = coord(
	"SELECT token FROM idempotency.idem_claim('before-1', scope => 'old')");
coord("SELECT token AS t FROM idempotency.idem_claim('before-2', scope => 'old') \\gset\n"
	  . "SELECT idempotency.idem_finish('before-2', :t, 201, '{\"n\": 2}', scope => 'old')");

is(sqlstate_of($coordinator, 'postgres', 'SELECT idempotency.distribute(0)'),
	'22023', 'distribute(0): 22023');
coord('SELECT idempotency.distribute()');
is( coord(
		    "SELECT string_agg(logicalrelid::text || ' ' || partmethod::text, ', ' ORDER BY 1) "
		  . 'FROM pg_dist_partition'),
	'idempotency.keys h, idempotency.scope_bindings n',
	'keys is distributed by hash, scope_bindings is a reference table');
is( coord(
		    "SELECT count(*) FROM pg_dist_shard WHERE logicalrelid = 'idempotency.keys'::regclass"),
	'32', 'keys has 32 shards');
is( coord(
		    "SELECT count(*) FROM pg_dist_object WHERE objid IN "
		  . "(SELECT p.oid FROM pg_proc p WHERE p.pronamespace = 'idempotency'::regnamespace "
		  . "AND 'scope' = ANY (p.proargnames)) AND distribution_argument_index IS NOT NULL "
		  . 'AND force_delegation'),
	'10', 'the ten functions with a scope are delegated by it, also in transaction blocks');
coord('SELECT idempotency.distribute()');
is(coord('SELECT count(*) FROM pg_dist_partition'),
	'2', 'distribute() a second time changes nothing');

is_deeply(
	claim($coordinator, 'postgres', "'before-2', scope => 'old'"),
	replay_row('succeeded', 201, coord(q{SELECT md5('{"n": 2}'::jsonb::text)})),
	'a key finished before distribute() replays');
is(coord("SELECT outcome FROM idempotency.idem_claim('before-1', scope => 'old')"),
	'in_progress', 'a key claimed before distribute() is still in progress');
is( coord(
		    "SELECT e IS NOT NULL FROM idempotency.idem_finish('before-1', $t_before, 200, scope => 'old') e"
	),
	't',
	'its owner finishes it with the token it got before');

# Every node's own copy of the table (Citus's shell) stays empty: the rows
# are in the shards.
for my $node (@nodes)
{
	is( $node->safe_psql('postgres',
			"SELECT pg_relation_size('idempotency.keys')"),
		'0',
		$node->name . ': idempotency.keys itself has no page');
}

# --- the same outcomes as a single server ---------------------------------------------

$coordinator->safe_psql('postgres', 'CREATE DATABASE single');
$coordinator->safe_psql('single',   'CREATE EXTENSION idempotency');
my $scenario = "$FindBin::Bin/citus/scenario.sql";
my @runs;
for my $db ('single', 'postgres')
{
	my ($ret, $out, $err) =
	  $coordinator->psql($db, slurp_file($scenario), on_error_stop => 0);
	push @runs, $out;
}
is($runs[1], $runs[0],
	'the scenario through the coordinator gives the single server\'s output');
like($runs[0], qr/^takeover b: claimed 2 reserved 00000$/m,
	'the scenario ran to its takeover');
like($runs[0], qr/^long scope: 22001$/m, 'and to its bad input');
is( coord(
		    "SELECT count(*) FROM idempotency.keys WHERE scope IN ('sc1','sc2','sc3','sc4','sc5')"
	),
	$coordinator->safe_psql('single', 'SELECT count(*) FROM idempotency.keys'),
	'the distributed table stores as many keys as the single server');

# --- 1,000 scopes over both workers ------------------------------------------------

my $script = join('',
	map { "SELECT outcome FROM idempotency.idem_claim('k', scope => 'tenant-$_');\n" }
	  1 .. 1000);
my $outcomes = $coordinator->safe_psql('postgres', $script);
is(scalar(grep { $_ eq 'claimed' } split /\n/, $outcomes),
	1000, '1,000 claims in 1,000 scopes through the coordinator: all claimed');
$outcomes = $coordinator->safe_psql('postgres', $script);
is(scalar(grep { $_ eq 'in_progress' } split /\n/, $outcomes),
	1000, 'a second claim of each answers in_progress');

# Each worker holds keys, and each key is in the shard Citus places its
# scope in (the shard's name on the worker carries its id).
my $total = 0;
for my $worker (@workers)
{
	my $n = $worker->safe_psql('postgres', <<'SQL');
SET citus.override_table_visibility = off;
SELECT count(*) FROM pg_class c
 WHERE c.relnamespace = 'idempotency'::regnamespace
   AND c.relname ~ '^keys_[0-9]+$';
SQL
	cmp_ok($n, '>', 0, $worker->name . ' holds shards of idempotency.keys');
	my @shards = split /\n/, $worker->safe_psql('postgres', <<'SQL');
SET citus.override_table_visibility = off;
SELECT substring(c.relname from '[0-9]+$') FROM pg_class c
 WHERE c.relnamespace = 'idempotency'::regnamespace
   AND c.relname ~ '^keys_[0-9]+$';
SQL
	@shards = grep { /^[0-9]+$/ } @shards;
	my $per_shard = join("\nUNION ALL ",
		map {
			    "SELECT count(*) FILTER (WHERE get_shard_id_for_distribution_column("
			  . "'idempotency.keys', scope) <> $_) AS bad, count(*) AS here "
			  . "FROM idempotency.keys_$_"
		} @shards);
	my ($bad, $here) = split /\|/,
	  $worker->safe_psql('postgres',
		"SELECT sum(bad), sum(here) FROM ($per_shard) s");
	is($bad, '0', $worker->name . ': every key is in the shard of its scope');
	cmp_ok($here, '>', 100, $worker->name . ' holds many of the 1,000 scopes');
	$total += $here;
}
is( $total,
	coord('SELECT count(*) FROM idempotency.keys'),
	'the workers\' shards hold every key the coordinator sees');

# --- refusals -------------------------------------------------------------------

my $keys_before = coord('SELECT count(*) FROM idempotency.keys');
my ($state, $out, $err) = sql_result($coordinator, 'postgres',
	"SELECT (idempotency.idem_claim('x', scope => 'tenant-1')).outcome = 'claimed'");
is($state, '0A000', 'a call Citus does not delegate: 0A000');
like($err, qr/idempotency scope "tenant-1" is stored on another node/,
	'with a message that says why');
like($err, qr/HINT:.*delegates/, 'and a hint on how to call it');

my $holder = shard_node_of($cluster, 'tenant-1');
my ($other) = grep { $_->port != $holder->port } @workers;
is(sqlstate_of($other, 'postgres',
		"SELECT (idempotency.idem_claim('x', scope => 'tenant-1')).outcome"),
	'0A000', 'the same on a worker that does not hold the scope: 0A000');
is(sqlstate_of($coordinator, 'postgres',
		"SELECT * FROM idempotency.idem_claim('x', scope => 'tenant-1', session_bound => true)"),
	'0A000', 'a session-bound claim: 0A000');
is(sqlstate_of($coordinator, 'postgres',
		"SELECT * FROM idempotency.idem_claim_many(ARRAY['x'], scope => 'tenant-1', session_bound => true)"),
	'0A000', 'a session-bound batch: 0A000');
is(coord('SELECT count(*) FROM idempotency.keys'),
	$keys_before, 'the refused calls wrote nothing');

# A trigger on the distributed table reaches its shards.  The library
# writes a shard only directly, which would bypass the trigger, so it
# refuses instead, and serves again once the trigger is gone.
coord(q{CREATE FUNCTION public.keep_row() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RETURN NEW; END$$});
coord(q{SET citus.enable_unsafe_triggers = on;
CREATE TRIGGER keep_row BEFORE INSERT OR UPDATE ON idempotency.keys
	FOR EACH ROW EXECUTE FUNCTION public.keep_row()});
($state, $out, $err) = sql_result($coordinator, 'postgres',
	"SELECT * FROM idempotency.idem_claim('triggered', scope => 'tenant-3')");
is($state, '0A000', 'a claim while the shards have a trigger: 0A000');
like($err, qr/the shards of idempotency\.keys have triggers/, 'which says why');
coord("SET citus.enable_unsafe_triggers = on;\nDROP TRIGGER keep_row ON idempotency.keys");
is(coord("SELECT outcome FROM idempotency.idem_claim('triggered', scope => 'tenant-3')"),
	'claimed', 'without the trigger the claim is served');
is(coord('SELECT count(*) FROM idempotency.keys'),
	$keys_before + 1, 'and only that claim wrote a key');

# A call on a worker is served by the node that holds the scope: there,
# or delegated by Citus from the other worker.
is( $holder->safe_psql('postgres',
		"SELECT outcome FROM idempotency.idem_claim('direct', scope => 'tenant-1')"),
	'claimed',
	'a call on the worker that holds the scope is served there');
is( $other->safe_psql('postgres',
		"SELECT outcome FROM idempotency.idem_claim('direct', scope => 'tenant-1')"),
	'in_progress',
	'the same call on the other worker is delegated to it');
is($holder->safe_psql('postgres', <<'SQL'), '1', 'and the key is stored once, in the shard of its scope');
SET citus.override_table_visibility = off;
SELECT count(*) FROM idempotency.keys WHERE scope = 'tenant-1' AND key = 'direct';
SQL

# --- scope bindings -----------------------------------------------------------------

coord('CREATE ROLE app_a LOGIN');
coord('GRANT USAGE ON SCHEMA idempotency TO app_a');
coord("SELECT idempotency.bind_scope('app_a', 'tenant-1')");
is( $coordinator->safe_psql('postgres',
		"SELECT outcome FROM idempotency.idem_claim('bound', scope => 'tenant-11')",
		extra_params => [ '-U', 'app_a' ]),
	'claimed',
	'a bound role claims in a scope of its prefix');
my @denied = grep {
	sqlstate_of($coordinator, 'postgres',
		"SELECT * FROM idempotency.idem_claim('bound', scope => '$_')",
		user => 'app_a') eq '42501'
} map { "other-$_" } 1 .. 40;
is(scalar(@denied), 40,
	'and is refused (42501) in 40 other scopes, wherever their shards are');
is(coord("SELECT idempotency.unbind_scope('app_a')"), 't', 'unbind_scope: true');
is(coord("SELECT idempotency.unbind_scope('app_a')"), 'f', 'a second time: false');
is( $coordinator->safe_psql('postgres',
		"SELECT outcome FROM idempotency.idem_claim('bound', scope => 'other-1')",
		extra_params => [ '-U', 'app_a' ]),
	'claimed',
	'once unbound, the role reaches every scope again');

# --- stats, per node and summed ------------------------------------------------

my $claims = coord(
	'SELECT sum(claims) FROM idempotency.cluster_stats');
my $rows = coord('SELECT count(*) FROM idempotency.cluster_stats');
is($rows, '3', 'cluster_stats: one row per node');
is( coord(
		"SELECT claims FROM idempotency.cluster_stats WHERE node = '127.0.0.1:31613'"),
	coord('SELECT claims FROM idempotency.stats WHERE database = current_database()'),
	'the coordinator\'s row is its own stats view');
for my $worker (@workers)
{
	my $port = $worker->port;
	is( coord(
			    'SELECT claims || \' \' || pending FROM idempotency.cluster_stats '
			  . "WHERE node = '127.0.0.1:$port'"),
		$worker->safe_psql('postgres',
			'SELECT claims || \' \' || pending FROM idempotency.stats '
			  . 'WHERE database = current_database()'),
		$worker->name . '\'s row is its own stats view');
}
is( coord(
		'SELECT sum(pending) + sum(succeeded) + sum(failed) FROM idempotency.cluster_stats'),
	coord(
		"SELECT count(*) FROM idempotency.keys WHERE expires_at > now()"),
	'the nodes\' key counts sum to the keys of the cluster');
cmp_ok($claims, '>=', 1000,
	'the claims counted over the nodes include the 1,000 of the scopes test');
cmp_ok(coord('SELECT sum(in_progress) FROM idempotency.cluster_stats'),
	'>=', 1000, 'and so do their in_progress answers');

citus_stop($cluster);
done_testing();
