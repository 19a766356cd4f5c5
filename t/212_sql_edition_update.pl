
# Copyright: the idempotency extension authors.
#
# 212_sql_edition_update.pl: the SQL edition updates from every version it
# released to the newest, through either installer, and keeps every key.
#
# The SQL edition's code is its SQL, so each release is a version of its own
# (sql-edition/versions; a released version's script is frozen as
# sql-edition/idempotency--VERSION.sql).  For each released version:
#   - it is installed as that release did, by the admin role a platform
#     gives its users ($SQL_ADMIN: no superuser, owner of the database,
#     pgtle_admin under pg_tle): through pg_tle, that version's
#     scripts registered (with the update paths between them) and CREATE
#     EXTENSION idempotency VERSION; plain, its script run into schema
#     idempotency;
#   - keys in every state are stored: finished with a response, failed,
#     pending under a live lease, pending with an ended lease, at a
#     recovery point, and a batch claimed and finished together;
#   - the newest installer runs over it, run by the same role (through
#     pg_tle it registers only
#     what is new, then ALTER EXTENSION idempotency UPDATE; plain, it
#     replaces the functions in place), and runs again without error;
#   - nothing stored changed: every row in the same place (ctid, xmin) with
#     every column, and the token sequence where it was;
#   - the version is the newest (extversion through pg_tle) and
#     idem_version() names it;
#   - the keys work with the tokens from before: finished keys replay, a
#     different request is a mismatch, the live key is in progress and its
#     holder extends, checkpoints and finishes it, the stale key is taken
#     over (attempt 2, a larger token, the recovery point it had) and its
#     old token is refused (55006);
#   - the catalog is a fresh install's, definition for definition, owners
#     and privileges included (catalog_queries, and every function of the
#     schema for the plain installer, which makes no extension).
# Against the C edition the file skips: its updates are 211_upgrade.pl's.
#
# Run it like the other TAP tests (see the top of t/001_restart.pl), with
# IDEM_EDITION=plain or pgtle.  Port 55478 only names the socket file.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

plan skip_all => 'C edition: its updates are tested by 211_upgrade.pl'
  unless sql_edition();

my $edition_dir = "$FindBin::Bin/../sql-edition";
my @versions = grep { /\S/ && !/^\s*#/ } split /\n/,
  slurp_file("$edition_dir/versions");
s/\s+//g for @versions;
my $newest = pop @versions;
my @released = @versions;
ok(scalar(@released) >= 1,
	'the SQL edition has released versions to update from: ' . join(', ', @released));

# The frozen script of released version $v.
sub script_of
{
	my ($v) = @_;
	return slurp_file("$edition_dir/idempotency--$v.sql");
}

# The update script from $from to $to, as scripts/sql-edition.sh picks it:
# idempotency--FROM--TO.sql when there is one, else the newer full script.
sub update_of
{
	my ($from, $to) = @_;
	my $file = "$edition_dir/idempotency--$from--$to.sql";
	return -f $file ? slurp_file($file) : script_of($to);
}

my $node = new_node('sqlupdate', port => 55478);
IdemTest::sql_admin($node);

sub sql { my ($db, $sql) = @_; return $node->safe_psql($db, $sql); }

# As the installing role.
sub as_admin
{
	my ($db, $sql) = @_;
	return $node->safe_psql($db, $sql, extra_params => [ '-U', $SQL_ADMIN ]);
}

my $pgtle = $IdemTest::EDITION eq 'pgtle';

# A dollar quote none of the scripts contains.
my $q = '$_idempotency_update_test_$';

# Install released version $v into the new database $db, as its release's
# installer did.
sub install_released
{
	my ($db, $v) = @_;
	sql('postgres', "CREATE DATABASE $db TEMPLATE template0 OWNER $SQL_ADMIN");
	if ($pgtle)
	{
		# the versions up to $v, each registered, and the update paths
		# between neighbours, as scripts/sql-edition.sh builds them
		my @upto;
		for my $r (@released)
		{
			push @upto, $r;
			last if $r eq $v;
		}
		sql($db, "CREATE EXTENSION pg_tle");
		my $reg = '';
		for my $i (0 .. $#upto)
		{
			my $text = script_of($upto[$i]);
			$reg .=
			  $i == 0
			  ? "SELECT pgtle.install_extension('idempotency', '$upto[$i]', 'idempotency keys', $q$text$q, NULL, 'idempotency');\n"
			  : "SELECT pgtle.install_extension_version_sql('idempotency', '$upto[$i]', $q$text$q);\n"
			  . "SELECT pgtle.install_update_path('idempotency', '$upto[$i - 1]', '$upto[$i]', $q"
			  . update_of($upto[$i - 1], $upto[$i])
			  . "$q);\n";
		}
		$reg .= "SELECT pgtle.set_default_version('idempotency', '$v');\n";
		as_admin($db, $reg);
		as_admin($db, "CREATE EXTENSION idempotency VERSION '$v'");
	}
	else
	{
		as_admin($db,
			"BEGIN;\nCREATE SCHEMA idempotency;\n"
			  . script_of($v) . "\nCOMMIT;");
	}
	return;
}

# Run the newest installer into $db (and update the extension through
# pg_tle).
sub install_newest
{
	my ($db) = @_;
	as_admin($db, IdemTest::installer_sql());
	as_admin($db, 'ALTER EXTENSION idempotency UPDATE') if $pgtle;
	return;
}

# A fresh install of the newest version, to compare catalogs with.
sql('postgres', "CREATE DATABASE fresh TEMPLATE template0 OWNER $SQL_ADMIN");
sql('fresh', 'CREATE EXTENSION pg_tle') if $pgtle;
as_admin('fresh', IdemTest::installer_sql());
as_admin('fresh', 'CREATE EXTENSION idempotency') if $pgtle;

# Every function of schema idempotency: definition, owner and privileges.
my $schema_functions_sql =
    "SELECT string_agg(pg_get_functiondef(p.oid) || 'owner ' || p.proowner::regrole "
  . "|| ', acl ' || coalesce(p.proacl::text, 'default'), E'\\n' "
  . "ORDER BY p.oid::regprocedure::text) FROM pg_proc p "
  . "WHERE p.pronamespace = 'idempotency'::regnamespace";
my $seq_sql = 'SELECT last_value FROM idempotency.token_seq';

for my $v (@released)
{
	(my $db = "from_$v") =~ s/\W/_/g;
	install_released($db, $v);
	is(sql($db, 'SELECT idempotency.idem_version()') =~ /^\Q$v\E(\.|$)/ ? 1 : 0,
		1, "$v: installed, idem_version() names a release of $v");

	# keys in every state
	my $done = claim($node, $db, "'done', '{\"n\": 1}', lease => '1 hour'");
	sql($db,
		"SELECT idempotency.idem_finish('done', $done->{token}, 200, '{\"paid\": true}')");
	my $failed = claim($node, $db, "'failed', '{\"n\": 2}', lease => '1 hour'");
	sql($db,
		"SELECT idempotency.idem_finish('failed', $failed->{token}, 502, '{\"error\": \"upstream\"}', status => 'failed')"
	);
	my $live = claim($node, $db, "'live', '{\"n\": 3}', lease => '1 hour'");
	my $stale = claim($node, $db, "'stale', '{\"n\": 4}', lease => '1 second'");
	sql($db,
		"SELECT idempotency.idem_checkpoint('stale', $stale->{token}, 'charged', '{\"charge\": \"ch_1\"}')"
	);
	is(sql($db,
			"SELECT count(*) FROM idempotency.idem_finish_many(ARRAY['b1', 'b2'], "
			  . "(SELECT array_agg(token ORDER BY key) FROM idempotency.idem_claim_many(ARRAY['b1', 'b2'], "
			  . "ARRAY['{\"b\": 1}', '{\"b\": 2}']::jsonb[], lease => '1 hour')), ARRAY[200, 200])"),
		'2', "$v: a batch claimed and finished");
	ok(wait_lease_over($node, $db, '', 'stale'), "$v: the stale key's lease ended");

	my $rows_before = key_rows($node, $db);
	my $seq_before = sql($db, $seq_sql);

	install_newest($db);
	install_newest($db);
	pass("$v: the newest installer ran over it, twice");

	is(key_rows($node, $db), $rows_before,
		"$v: every stored row is where it was, every column unchanged");
	is(sql($db, $seq_sql), $seq_before, "$v: the token sequence did not move");
	is(sql($db, 'SELECT idempotency.idem_version()'), $newest,
		"$v: idem_version() names the newest version, $newest");
	is(sql($db, "SELECT extversion FROM pg_extension WHERE extname = 'idempotency'"),
		$newest, "$v: the extension is at $newest")
	  if $pgtle;

	# the keys, with the tokens from before
	is_deeply(claim($node, $db, "'done', '{\"n\": 1}'"),
		replay_row('succeeded', 200, body_md5($node, $db, q('{"paid": true}'))),
		"$v: the finished key replays its response");
	is_deeply(claim($node, $db, "'failed', '{\"n\": 2}'"),
		replay_row('failed', 502, body_md5($node, $db, q('{"error": "upstream"}'))),
		"$v: the failed key replays its response");
	is_deeply(claim($node, $db, "'done', '{\"n\": 99}'"),
		mismatch_row(), "$v: another request under a finished key is a mismatch");
	is(claim($node, $db, "'live', '{\"n\": 3}'")->{outcome},
		'in_progress', "$v: the live key is in progress");
	is(sql($db,
			"SELECT idempotency.idem_extend('live', $live->{token}, '2 hours') > now() + interval '1 hour'"),
		't', "$v: the live key's holder extends it with its token from before");
	is(sqlstate_of($node, $db,
			"SELECT idempotency.idem_checkpoint('live', $live->{token}, 'shipped', '{\"parcel\": 7}')"),
		'00000', "$v: and checkpoints it");
	is(sql($db,
			"SELECT idempotency.idem_finish('live', $live->{token}, 201, '{\"id\": 3}') IS NOT NULL"),
		't', "$v: and finishes it");
	is_deeply(claim($node, $db, "'live', '{\"n\": 3}'"),
		replay_row('succeeded', 201, body_md5($node, $db, q('{"id": 3}'))),
		"$v: the live key replays the finish");
	is(sql($db,
			"SELECT concat_ws('|', outcome, attempt, token > $seq_before, phase, phase_data) "
			  . "FROM idempotency.idem_claim('stale', '{\"n\": 4}')"),
		'claimed|2|t|charged|{"charge": "ch_1"}',
		"$v: the stale key is taken over: attempt 2, a larger token, its recovery point");
	is(sqlstate_of($node, $db,
			"SELECT idempotency.idem_finish('stale', $stale->{token}, 200)"),
		'55006', "$v: the stale key's old token is refused (55006)");

	# the catalog
	my %catalog = (catalog_queries(),
		'every function of the schema (definition, owner, privileges)' =>
		  $schema_functions_sql);
	for my $what (sort keys %catalog)
	{
		is(sql($db, $catalog{$what}), sql('fresh', $catalog{$what}),
			"$v: $what as a fresh install's");
	}
}

done_testing();
