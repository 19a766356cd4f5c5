
# Copyright: the idempotency extension authors.
#
# 202_standby_failover.pl: a streaming hot standby, then a failover to it.
#
# What it proves:
#   - on the hot standby, idem_lookup answers exactly what the primary
#     answers for every key (finished, failed, pending, absent), also for a
#     tenant-bound role (whose binding is enforced there too: 42501), and the
#     idempotency.stats view and stats_counters() answer;
#   - every other function raises read_only_sql_transaction (25006) on the
#     standby before reading anything: a finish, extend or release of a key
#     that does not exist raises 25006 (not P0002), a finish with a wrong
#     token raises 25006 (not 55006), and a claim of a finished key raises
#     25006 (it does not replay); idem_sweep too; for superusers and app roles;
#   - after the primary is stopped and the standby promoted: every finished
#     key replays its identical stored response; a pending key whose owner
#     is alive keeps its token (the owner finishes it on the new primary); a
#     pending key whose owner died is reclaimable once its lease has passed,
#     as attempt 2 with a new token, and the dead owner's token is refused
#     (55006); every new token is larger than any token the standby had seen
#     (in the table or in the sequence); the new primary can sweep.
#
# Run as described at the top of t/001_restart.pl.  Ports 55445 and 55446
# only name the socket files.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use List::Util qw(max);
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $primary = new_node('primary', port => 55445,
	init => [ allows_streaming => 1, extra => [ '--encoding=UTF8', '--locale=C' ] ]);
install_extension($primary, 'postgres');
$primary->safe_psql(
	'postgres', q{
CREATE ROLE app LOGIN;
CREATE ROLE tenant LOGIN;
GRANT USAGE ON SCHEMA idempotency TO app, tenant;
SELECT idempotency.bind_scope('tenant', 't:');
});

sub lookup
{
	my ($node, $key, $scope, $role) = @_;
	my $set = defined $role ? "SET ROLE $role;\n" : '';
	return $node->safe_psql('postgres',
		    "${set}SELECT concat_ws('|', status, attempt, response_code, "
		  . "md5(response_body::text), created_at, finished_at, expires_at) "
		  . "FROM idempotency.idem_lookup('$key', scope => '$scope')");
}

my @tokens;    # every token the primary handed out
sub max_token { return max(0, @tokens); }

sub claimed
{
	my ($args, $role) = @_;
	my $c = claim($primary, 'postgres', $args, role => $role);
	is($c->{outcome}, 'claimed', "primary: claim($args) is claimed");
	cmp_ok($c->{token}, '>', max_token(), "primary: claim($args) token is the largest so far");
	push @tokens, $c->{token};
	return $c;
}

sub finish
{
	my ($key, $token, $rest) = @_;
	$primary->safe_psql('postgres',
		"SELECT idempotency.idem_finish('$key', $token$rest)");
}

my %body = (
	ok     => q{'{"order": 1, "total": 100.0}'},
	failed => q{'{"error": "card declined"}'},
	tenant => q{'{"tenant": "t", "text": "ünïcødé ✓"}'},
	late   => q{'{"late": "but alive"}'},
	big    => q{(SELECT jsonb_agg(md5(i::text)) FROM generate_series(1, 5000) i)},
);
my %md5;
$md5{$_} = body_md5($primary, 'postgres', $body{$_}) foreach keys %body;

# --- keys written before the base backup -----------------------------------
my $c = claimed(q{'ok-1', request => '{"order": 1}'});
finish('ok-1', $c->{token}, ", 201, $body{ok}");
$c = claimed(q{'fail-1', request => '{"order": 2}'});
finish('fail-1', $c->{token}, ", 402, $body{failed}, status => 'failed'");

my $standby = new_standby($primary, 'standby', port => 55446);
# The primary's worker is off from here on (the standby keeps the setting
# it was copied with): it would otherwise reset the dead owner's key below
# once its lease has passed, and the standby checks that key's token.
stop_sweeping($primary);

# --- keys written while the standby streams --------------------------------
$c = claimed(q{'order', request => '{"sku": 1}', scope => 't:shop'}, 'tenant');
$primary->safe_psql('postgres',
	    "SET ROLE tenant; SELECT idempotency.idem_finish('order', $c->{token}, 200, "
	  . "$body{tenant}, scope => 't:shop')");
$c = claimed(q{'big', scope => 'toast'}, 'app');
finish('big', $c->{token}, ", 200, $body{big}, scope => 'toast'");
$c = claimed(q{'bare'});
finish('bare', $c->{token}, '');

# Pending: one owner stays alive (long lease), one dies (short lease).
$c = claimed(q{'alive', request => '{"job": 1}', lease => '1 hour'});
my $alive_token = $c->{token};
$c = claimed(q{'dead', request => '{"job": 2}', lease => '2 seconds'});
my $dead_token = $c->{token};

# Tokens no row keeps: a released claim and a rolled-back claim.
$c = claimed(q{'released'});
$primary->safe_psql('postgres', "SELECT idempotency.idem_release('released', $c->{token})");
my $rb = $primary->safe_psql('postgres',
	"BEGIN; SELECT token FROM idempotency.idem_claim('rolled-back'); ROLLBACK;");
cmp_ok($rb, '>', max_token(), 'primary: the rolled-back claim drew the largest token');
push @tokens, $rb;
# A committed transaction after it, so its sequence WAL is flushed and sent.
$c = claimed(q{'last', request => '{"n": 1}'});
finish('last', $c->{token}, ', 200');

$primary->wait_for_catchup($standby);

# --- on the standby ----------------------------------------------------------
is($standby->safe_psql('postgres', 'SELECT pg_is_in_recovery()'),
	't', 'standby: in recovery');

my @keys = (
	[ 'ok-1', '' ], [ 'fail-1', '' ], [ 'order', 't:shop' ], [ 'big', 'toast' ],
	[ 'bare', '' ], [ 'alive', '' ], [ 'dead', '' ], [ 'last', '' ],
	[ 'released', '' ], [ 'rolled-back', '' ], [ 'never', '' ]);
my %primary_lookup;
foreach my $k (@keys)
{
	my ($key, $scope) = @$k;
	$primary_lookup{"$scope/$key"} = lookup($primary, $key, $scope);
	is(lookup($standby, $key, $scope), $primary_lookup{"$scope/$key"},
		"standby: idem_lookup('$key', '$scope') answers what the primary answers");
}
like($primary_lookup{'/ok-1'}, qr/^succeeded\|1\|201\|$md5{ok}\|/,
	'primary: ok-1 is succeeded with its code and body');
like($primary_lookup{'/alive'}, qr/^pending\|1\|\d{4}-/,
	'primary: alive is pending, attempt 1, no code or body');
is($primary_lookup{'/released'}, '', 'primary: released key is absent');
is($primary_lookup{'/never'},    '', 'primary: unknown key is absent');

is(lookup($standby, 'order', 't:shop', 'tenant'), $primary_lookup{'t:shop/order'},
	'standby: the tenant role looks up its own scope');
is(sqlstate_of($standby, 'postgres',
		"SET ROLE tenant; SELECT * FROM idempotency.idem_lookup('ok-1', scope => '')"),
	'42501', 'standby: the tenant role may not look up another scope (42501)');

is( $standby->safe_psql('postgres',
		"SELECT concat_ws(',', pending, succeeded, failed) FROM idempotency.stats "
		  . "WHERE database = current_database()"),
	'2,5,1', 'standby: stats counts 2 pending, 5 succeeded, 1 failed');
is(sqlstate_of($standby, 'postgres', 'SELECT * FROM idempotency.stats_counters()'),
	'00000', 'standby: stats_counters() answers');
is($standby->safe_psql('postgres', 'SET ROLE app; SELECT count(*) FROM idempotency.stats'),
	'1', 'standby: an app role reads the stats view');

# Every other function: 25006, before reading anything.
my @refused = (
	[ "SELECT * FROM idempotency.idem_claim('new-key')",        'claim of a new key' ],
	[ "SELECT * FROM idempotency.idem_claim('ok-1', request => '{\"order\": 1}')",
		'claim of a finished key (no replay)' ],
	[ "SELECT * FROM idempotency.idem_claim('alive', request => '{\"job\": 1}')",
		'claim of a pending key' ],
	[ "SELECT * FROM idempotency.idem_claim('x', wait => '1 s')", 'claim with wait' ],
	[ "SELECT idempotency.idem_finish('alive', $alive_token, 200)", 'finish by the owner' ],
	[ "SELECT idempotency.idem_finish('alive', 1, 200)", 'finish with a wrong token (not 55006)' ],
	[ "SELECT idempotency.idem_finish('never', 1, 200)", 'finish of an absent key (not P0002)' ],
	[ "SELECT idempotency.idem_finish('ok-1', 1, 200)", 'finish of a finished key (not 55000)' ],
	[ "SELECT idempotency.idem_extend('alive', $alive_token)", 'extend by the owner' ],
	[ "SELECT idempotency.idem_extend('never', 1)", 'extend of an absent key (not P0002)' ],
	[ "SELECT idempotency.idem_release('alive', $alive_token)", 'release by the owner' ],
	[ "SELECT idempotency.idem_release('never', 1)", 'release of an absent key (not P0002)' ],
	[ "SELECT * FROM idempotency.idem_sweep()",   'sweep' ],
	[ "SELECT * FROM idempotency.idem_sweep(10)", 'sweep with a batch size' ],
);
foreach my $r (@refused)
{
	my ($sql, $what) = @$r;
	is(sqlstate_of($standby, 'postgres', $sql), '25006', "standby: $what raises 25006");
}
is( sqlstate_of($standby, 'postgres',
		"SET ROLE app; SELECT * FROM idempotency.idem_claim('k')"),
	'25006', 'standby: an app role\'s claim raises 25006');
is(sqlstate_of($standby, 'postgres',
		"SET ROLE tenant; SELECT * FROM idempotency.idem_claim('k', scope => 't:a')"),
	'25006', 'standby: a tenant role\'s claim raises 25006');
like(
	($standby->psql('postgres', "SELECT * FROM idempotency.idem_claim('k')"))[2],
	qr/cannot execute idem_claim\(\) during recovery/,
	'standby: the message names the function');

# What the standby has seen: tokens in the table and the sequence position.
my $seen = $standby->safe_psql('postgres',
	"SELECT greatest((SELECT max(token) FROM idempotency.keys), "
	  . "(SELECT last_value FROM idempotency.token_seq))");
cmp_ok($seen, '>=', max_token(), 'standby: has seen every token the primary issued');
# Every column of every row.  The token of the dead owner's key is left out
# of the comparison after the failover: the new primary's sweeper may reset
# it (token NULL) as soon as its lease has passed; that is checked apart.
my $rows_sql =
    "SELECT string_agg(concat_ws('|', quote_literal(scope), quote_literal(key), status, "
  . "CASE WHEN key = 'dead' THEN 'T' ELSE coalesce(token::text, 'NULL') END, attempt, "
  . "coalesce(encode(fingerprint, 'hex'), 'NULL'), coalesce(response_code::text, 'NULL'), "
  . "coalesce(md5(response_body::text), 'NULL'), created_at, "
  . "coalesce(finished_at::text, 'NULL'), coalesce(lease_until::text, 'NULL'), "
  . "expires_at, retention), E'\\n' ORDER BY scope, key) FROM idempotency.keys";
my $standby_rows = $standby->safe_psql('postgres', $rows_sql);
is($standby_rows, $primary->safe_psql('postgres', $rows_sql),
	'standby: its table is the primary\'s, after all those refused calls');
is($standby->safe_psql('postgres', "SELECT token FROM idempotency.keys WHERE key = 'dead'"),
	$dead_token, 'standby: the dead owner\'s key still carries its token');

# --- failover ------------------------------------------------------------------
$primary->stop('immediate');
$standby->promote;
ok($standby->poll_query_until('postgres', 'SELECT NOT pg_is_in_recovery()'),
	'the standby is promoted');
my $new = $standby;

is($new->safe_psql('postgres', $rows_sql), $standby_rows,
	'new primary: every key as the standby had it');
like($new->safe_psql('postgres',
		"SELECT coalesce(token::text, 'reset') FROM idempotency.keys WHERE key = 'dead'"),
	qr/^($dead_token|reset)$/,
	'new primary: the dead owner\'s key has its token, or the sweeper reset it');

# Every finished key replays its stored result.
my @replays = (
	[ q{'ok-1', request => '{"order": 1}'}, 'succeeded', 201, $md5{ok} ],
	[ q{'fail-1', request => '{"order": 2}'}, 'failed', 402, $md5{failed} ],
	[ q{'order', request => '{"sku": 1}', scope => 't:shop'}, 'succeeded', 200, $md5{tenant}, 'tenant' ],
	[ q{'big', scope => 'toast'}, 'succeeded', 200, $md5{big}, 'app' ],
	[ q{'bare'}, 'succeeded', undef, undef ],
	[ q{'last', request => '{"n": 1}'}, 'succeeded', 200, undef ],
);
foreach my $r (@replays)
{
	my ($args, $status, $code, $md5, $role) = @$r;
	is_deeply(
		claim($new, 'postgres', $args, role => $role),
		replay_row($status, $code, $md5),
		"new primary: claim($args) replays the stored $status result");
}
is(claim($new, 'postgres', q{'ok-1', request => '{"order": 3}'})->{outcome},
	'mismatch', 'new primary: ok-1 with another request is a mismatch');

# A new key's token is above everything the standby had seen.
$c = claim($new, 'postgres', q{'after-failover', lease => '1 hour'}, role => 'app');
is($c->{outcome}, 'claimed', 'new primary: an app role claims a new key');
is($c->{attempt}, 1,         'new primary: attempt 1');
cmp_ok($c->{token}, '>', $seen, 'new primary: its token is above any token the standby had seen');
cmp_ok($c->{token}, '>', max_token(), 'new primary: and above any the old primary issued');
my $after = $c->{token};

# The live owner keeps its claim across the failover.
$c = claim($new, 'postgres', q{'alive', request => '{"job": 1}'});
is($c->{outcome}, 'in_progress', 'new primary: alive is in progress (lease kept)');
cmp_ok($c->{retry_after}, '>', 1, 'new primary: retry_after counts the long lease');
is( sqlstate_of($new, 'postgres',
		"SELECT idempotency.idem_extend('alive', $alive_token, '2 hours')"),
	'00000', 'new primary: the owner extends its lease with its old token');
is( sqlstate_of($new, 'postgres',
		"SELECT idempotency.idem_finish('alive', $alive_token, 200, $body{late})"),
	'00000', 'new primary: the owner finishes with its old token');
$c = claim($new, 'postgres', q{'alive', request => '{"job": 1}'});
is($c->{outcome},  'replay',   'new primary: alive replays');
is($c->{body_md5}, $md5{late}, 'new primary: with the owner\'s body');

# The dead owner's key is reclaimable once its lease has passed.
ok(wait_lease_over($new, 'postgres', '', 'dead'),
	'new primary: the dead owner\'s lease has passed');
$c = claim($new, 'postgres', q{'dead', request => '{"job": 2}', lease => '1 hour'});
is($c->{outcome}, 'claimed', 'new primary: dead is claimed again');
is($c->{attempt}, 2,         'new primary: as attempt 2');
cmp_ok($c->{token}, '>', $after, 'new primary: the takeover token is the largest yet');
my $takeover = $c->{token};
is($new->safe_psql('postgres',
		"SELECT status || ',' || token || ',' || attempt FROM idempotency.keys "
		  . "WHERE scope = '' AND key = 'dead'"),
	"pending,$takeover,2", 'new primary: stored row: pending, new token, attempt 2');
is(sqlstate_of($new, 'postgres', "SELECT idempotency.idem_finish('dead', $dead_token, 500)"),
	'55006', 'new primary: the dead owner\'s token is refused (55006)');
is( sqlstate_of($new, 'postgres',
		"SELECT idempotency.idem_finish('dead', $takeover, 200, $body{ok})"),
	'00000', 'new primary: the new owner finishes');
$c = claim($new, 'postgres', q{'dead', request => '{"job": 2}'});
is($c->{outcome},       'replay', 'new primary: dead replays the new owner\'s result');
is($c->{response_code}, 200,      'new primary: with its code');
is($new->safe_psql('postgres', "SELECT attempt FROM idempotency.idem_lookup('dead')"),
	'2', 'new primary: lookup reports attempt 2');

# The new primary counts (its counters started at the promotion's server start).
SKIP:
{
	skip 'SQL edition: the stats counters are NULL (they live in the C library\'s shared memory)', 1
	  if sql_edition();
	cmp_ok($new->safe_psql('postgres',
			"SELECT claims FROM idempotency.stats WHERE database = current_database()"),
		'>=', 2, 'new primary: stats counts its claims');
}

# The new primary sweeps.
is(sqlstate_of($new, 'postgres', 'SELECT * FROM idempotency.idem_sweep()'),
	'00000', 'new primary: idem_sweep runs');
like($new->safe_psql('postgres', 'SELECT expired || \',\' || reset FROM idempotency.idem_sweep()'),
	qr/^\d+,\d+$/, 'new primary: idem_sweep returns its counts');

$new->stop;
done_testing();
